"""Activation quantizers of a plan: dynamic specs as they are, static ones calibrated from data.

``activation_quantizers(params, plan, calibrator)`` returns ``{Site: QuantSpec | QParams}`` for
every site of :attr:`Plan.activations`: a dynamic spec (fitted to each activation at run time)
as it is, a static one as :class:`~qtransform.QParams` from an observer (``minmax`` by default,
or ``percentile``/``mse``/``histogram`` with their options) folded over the calibration batches
at that site, the model's tensors taken from ``params`` (the bridge passes the weights as they
will run: quantized and dequantized). A static spec applies to the activation's (tokens,
features) matrix (every leading axis flattened into tokens; convolution activations keep their
``(N, C, H, W)`` layout): per tensor, per feature (``PerChannel(-1)``) or per group of features;
per token (``PerChannel(0)``) only dynamically. The input of a stacked experts weight (one site per projection of a
mixture-of-experts layer) gets one static quantizer for all its experts, from the statistics of every expert's
routed tokens pooled. The key/value sites of the plan's attention modules
(``Site(module, "key")``) are calibrated per tensor or per key/value head (``PerChannel(1)``) on the keys and
values as the cache stores them (``(batch, heads, tokens, head_dim)``).

>>> import torch, qtransform as qt
>>> params = {"fc.weight": torch.eye(3)}
>>> spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True)
>>> plan = qt.Recipe(default=qt.QuantSpec(format="int8"), input=spec).plan(params)
>>> {site: (str(q), q.dynamic) for site, q in activation_quantizers(params, plan).items()}
{Site(module='fc', role='input'): ('int8 channel(axis=0) sym', True)}
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

from ..granularity import PerChannel
from ..observers import compute_qparams, init_stats, is_empty, merge_stats
from ..spec import KV_ROLES, ROLES, Plan, QuantSpec, Site
from ..tensor import QParams
from .run import serving

__all__ = ["activation_quantizers", "check_activation_spec", "CONV_TYPES"]

#: Module types whose activations keep their layout (no (tokens, features) matrix).
CONV_TYPES = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")


def check_activation_spec(spec: QuantSpec, where: str, *, conv: bool = False) -> None:
    """``ValueError`` naming ``where`` for a static spec no calibration can give (per token)."""
    if not spec.dynamic and not conv and isinstance(spec.granularity, PerChannel) and spec.granularity.axis == 0:
        raise ValueError(f"{where}: a static activation spec cannot be per token (PerChannel(0) on the (tokens, "
                         f"features) matrix: tokens differ at run time); use dynamic=True, or PerTensor / "
                         f"PerChannel(-1) (per feature) for static scales ({spec})")


def _stats_spec(spec: QuantSpec, conv: bool) -> QuantSpec:
    """The spec the statistics are gathered with on the raw activation (features on the last axis)."""
    g = spec.granularity
    if not conv and isinstance(g, PerChannel) and g.axis == 1:
        return dataclasses.replace(spec, granularity=PerChannel(-1))
    return spec


def pooled(stats, *, path: str):
    """One statistics of a site: a stacked experts weight's per-expert tuple (:class:`Plan.site_module`) merged
    over the experts that tokens reached (one static quantizer serves every expert's input), else as it is."""
    if not isinstance(stats, tuple):
        return stats
    seen = [s for s in stats if not is_empty(s)]
    if not seen:
        raise ValueError(f"{path}: no calibration token reached any of its {len(stats)} experts")
    return functools.reduce(lambda a, b: merge_stats(a, b, path=path), seen)


def activation_quantizers(params: Mapping[str, Any], plan: Plan, calibrator=None, *, observer=None,
                          online: Mapping | None = None, **options) -> dict[Site, QuantSpec | QParams]:
    """``{Site: dynamic QuantSpec | calibrated QParams}`` (see the module docstring). Static specs
    need a ``calibrator`` (``ValueError`` naming the sites otherwise); ``online``: the rotations the
    steps recorded (``Fit.online``), applied before the activations are measured."""
    if getattr(plan.recipe, "kv_cache", None) is not None and not plan.attention:
        raise ValueError("Recipe.kv_cache quantizes the key/value cache of attention layers, but the plan names no "
                         "attention module (the bridge finds them in transformers models: bridge.quantize, the CLI)")
    sites = plan.activations
    conv = {s: plan[p].module_type in CONV_TYPES for s in sites if s.role in ROLES for p in plan.sites(s.role).get(s, ())}
    for s, spec in sites.items():
        check_activation_spec(spec, f"{s.module} ({s.role})", conv=conv.get(s, False))
    out: dict[Site, Any] = {s: spec for s, spec in sites.items() if spec.dynamic}
    static = {s: spec for s, spec in sites.items() if not spec.dynamic}
    if not static:
        return out
    if calibrator is None:
        names = [f"{s.module} ({s.role})" for s in static]
        raise ValueError(f"static activation specs need calibration data for {names[:3]}"
                         + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                         + ": pass calibration batches (bridge.quantize(..., calibration=...), `qtransform quantize "
                           "--calib N`), or use dynamic=True specs")
    empty = {s: init_stats(_stats_spec(spec, conv.get(s, s.role in KV_ROLES)), observer=observer, **options)
             for s, spec in static.items()}
    stats = calibrator.site_stats(dict(params), empty, **({"online": dict(online)} if online else {}),
                                  **serving(calibrator, "site_stats", "activations"))
    for s, spec in static.items():
        qp = compute_qparams(pooled(stats[s], path=f"{s.module} ({s.role})"), path=f"{s.module} ({s.role})")
        out[s] = QParams(spec=spec, **qp.tensors())
    return {s: out[s] for s in sites}
