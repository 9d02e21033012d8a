"""The ``rotate`` step: QuaRot's rotations (:func:`qtransform.rotate`, :mod:`qtransform.rotation.online`)
before quantization.

Options: ``layout`` (a :class:`~qtransform.rotation.ResidualLayout` or its dict, replacing the plan's
``Plan.layout``, which the bridge fills from the model's architecture table), ``rotation`` (``"hadamard"``: a randomised Hadamard matrix for
``R1`` and a Hadamard matrix for ``R2``, falling back to :func:`qtransform.orthogonal` for widths
without one; ``"random"``: random orthogonal matrices), ``seed``, ``heads`` (also rotate each value
/ output head pair by ``R2``, default true), ``r4`` (an online Hadamard transform of each down
projection's input, its weight holding ``W H``; default true) and ``r3`` (an online Hadamard
transform of the queries and keys after rotary embeddings; default: when the recipe quantizes the
key cache). Needs no data; it changes the embeddings, the norms, the output head and every linear
the stream touches, so it runs on the whole tree (never while a checkpoint loads). The matrices are
computed in float64; the function is unchanged up to the weights' rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..rotation import ResidualLayout, apply_online, has_hadamard, online_hadamard, orthogonal, random_orthogonal
from ..rotation import rotate as rotate_tree
from ..formats import get_format
from ..spec import Site
from .base import Fit, register_algorithm
from .options import option, options_checker, received

__all__ = ["ROTATIONS", "rotation_matrix", "step", "Options", "check_options", "online_r3_r4", "fuse_online",
           "residual_width", "residual_tensor"]

ROTATIONS = ("hadamard", "random")


def rotation_matrix(n: int, rotation: str, seed: int, *, device=None) -> torch.Tensor:
    """The float64 ``n x n`` orthogonal matrix of ``rotation`` (see the module docstring), drawn on the host
    (a CPU generator: the same matrix whatever the device) and put on ``device`` (default: the host)."""
    if rotation == "random":
        m = random_orthogonal(n, seed, dtype=torch.float64)
    else:
        m = orthogonal(n, seed, dtype=torch.float64)
    return m if device is None else m.to(device)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """``rotate``'s options (see the module docstring)."""

    layout: Any = option(None, doc="a ResidualLayout or its dict, replacing the plan's (Plan.layout)")
    rotation: str = option("hadamard", choices=ROTATIONS, doc="hadamard or random orthogonal matrices")
    seed: int = option(0, doc="seed of the randomised matrices")
    heads: bool = option(True, doc="also rotate each value/output head pair (R2)")
    r3: bool | None = option(None, doc="online Hadamard on queries and keys (default: when the keys are quantized)")
    r4: bool = option(True, doc="online Hadamard before each down projection")

    def __post_init__(self):
        if self.layout is not None:
            ResidualLayout.from_value(self.layout, where="layout")


check_options = options_checker("rotate", Options)


def residual_width(params, lay: ResidualLayout) -> int:
    """The residual stream's width: the embeddings' last dimension, else (a part of the model without them,
    e.g. one decoder block quantized at a time) a norm's width."""
    return residual_tensor(params, lay).shape[-1]


def residual_tensor(params, lay: ResidualLayout) -> torch.Tensor:
    """The tensor :func:`residual_width` reads (its device is where the rotations are put)."""
    emb = params.get(lay.embeddings[0]) if lay.embeddings else None
    if isinstance(emb, torch.Tensor):
        return emb
    norm = next((params[n.weight] for n in lay.norms if isinstance(params.get(n.weight), torch.Tensor)), None)
    if norm is None:
        raise ValueError(f"rotate: layout embeddings {list(lay.embeddings)} and norms name no tensor of the tree: the "
                         "residual width is unknown")
    return norm


def _experts_down(params, plan, lay: ResidualLayout) -> None:
    """``ValueError`` for a stacked experts down projection (a 3-D writer) whose input the plan quantizes to
    fewer than 8 bits: ``R4`` would belong before it, inside the experts module's forward, where no online
    rotation reaches (QuaRot's 4-bit activations need it; 8-bit ones do without)."""
    acts = getattr(plan, "activations", None) or {}
    for w in lay.writers:
        t = params.get(w)
        spec = acts.get(Site(w, "input")) if isinstance(t, torch.Tensor) and t.dim() == 3 else None
        if spec is not None and get_format(spec.format).codec.bits < 8:
            raise ValueError(f"rotate: {w}: the recipe quantizes this experts down projection's input to "
                             f"{spec.format}, which needs the online Hadamard rotation R4 before it; an experts "
                             "module computes each expert's hidden activation inside its forward, where no online "
                             "rotation reaches. Use 8-bit activations (quarot-w4a8, spinquant-w4a8), or r4=False "
                             "to quantize it unrotated")


def online_r3_r4(params, plan, lay: ResidualLayout, *, r3, r4: bool) -> dict:
    """The online rotations of ``lay``, ``{Site: OnlineRotation}``: ``R4`` before each down projection,
    ``R3`` on each attention module's queries and keys (``r3=None``: where the plan quantizes the keys).
    A stacked experts down projection (a 3-D writer, never in ``lay.down``) gets none: with ``r4`` its input
    must not be quantized below 8 bits (``ValueError`` naming it)."""
    online = {}
    if r4:
        _experts_down(params, plan, lay)
        for path in lay.down:
            w = params.get(path)
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
                raise ValueError(f"rotate: layout down {path!r} is not a float 2-D weight of the tree")
            online[Site(path.rpartition(".")[0], "input")] = online_hadamard(w.shape[1])
    keyed = {s.module for s in plan.activations if s.role == "key"}
    for a in lay.attention:
        if r3 or (r3 is None and a.module in keyed):
            online[Site(a.module, "key")] = online_hadamard(a.head_dim)
    return online


def fuse_online(tree, online, *, dtype=torch.float64) -> dict:
    """The weights of the linears whose input ``online`` rotates, holding ``W H`` (computed in ``dtype``)."""
    paths = {f"{s.module}.weight": rot for s, rot in online.items() if s.role == "input"}
    return {p: apply_online(tree[p].to(dtype), rot).to(tree[p].dtype) for p, rot in paths.items()}


def step(params, plan, *, context, options: Options) -> Fit:
    """The ``rotate`` step (see the module docstring)."""
    o = received(Options, options, step="rotate")
    rotation, seed, heads = o.rotation, o.seed, o.heads
    layout = plan.layout if o.layout is None else o.layout
    if layout is None:
        raise ValueError("rotate: no residual layout: the plan has none (Plan.layout; bridge.plan fills it from the "
                         "model's architecture table, bridge.arch.residual_layout) and no layout option was given")
    lay = ResidualLayout.from_value(layout, where="rotate: layout")
    ref = residual_tensor(params, lay)
    d, dev = ref.shape[-1], ref.device
    R1 = rotation_matrix(d, rotation, seed, device=dev)
    R2 = rotation_matrix(lay.heads[0].head_dim, rotation, seed + 1, device=dev) if heads and lay.heads else None
    out = rotate_tree(params, lay if heads else lay._replace(heads=()), R1, R2)
    online = online_r3_r4(out, plan, lay, r3=o.r3, r4=o.r4)
    out.update(fuse_online(out, online))
    changed = {p: t for p, t in out.items() if t is not params.get(p)}
    info = {p: {"rotation": ("Hadamard" if rotation == "hadamard" and has_hadamard(d) else rotation)
                + f" {d}"} for p in changed if p in plan.specs}
    for site, rot in online.items():
        if f"{site.module}.weight" in info:
            info[f"{site.module}.weight"]["online"] = f"Hadamard {rot.size}"
    return Fit(params=changed, info=info, online=online)


register_algorithm("rotate", step, options=Options, requires=("layout",),
                   description="QuaRot: norms fused, residual stream and heads rotated (randomised Hadamard), "
                               "online Hadamard before the down projections (and on queries/keys); the function "
                               "unchanged")
