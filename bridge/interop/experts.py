"""Mixture-of-experts weights as other tools' checkpoints name them: one 2-D tensor per expert and projection.

transformers 5 holds a layer's experts as one module with stacked 3-D weights (``mlp.experts.gate_up_proj``
``(experts, 2·inter, hidden)``, gate rows first, and ``mlp.experts.down_proj`` ``(experts, hidden, inter)``), our
tree's paths. What reads an export does not: transformers' ``save_pretrained`` writes the original
per-expert layout back through its conversion mapping (``transformers/conversion_mapping.py``, and
``from_pretrained`` fuses it again), and vLLM's fused-MoE loaders read those per-expert names
(``FusedMoE.make_expert_params_mapping``), so compressed-tensors and Quark exports write, per expert ``e``:

==========================================  =========================================================
model types (:func:`namings`)              per-expert tensors of ``model.layers.N.mlp.experts``
==========================================  =========================================================
``mixtral``                                 ``model.layers.N.block_sparse_moe.experts.{e}.w1`` (gate),
                                            ``.w3`` (up), ``.w2`` (down); the router
                                            ``model.layers.N.mlp.gate`` is ``block_sparse_moe.gate``
``qwen2_moe``, ``qwen3_moe``, ``olmoe``,    ``model.layers.N.mlp.experts.{e}.gate_proj``, ``.up_proj``,
``deepseek_v2``, ``deepseek_v3``,           ``.down_proj``
``qwen3_next``
==========================================  =========================================================

each followed by the format's own tensor names (``.weight``, ``.weight_packed``, ``.weight_scale``...).
:func:`pieces` splits a stacked leaf (a QTensor or a float tensor) into those 2-D leaves without copying
(views of one expert, rows of the fused gate/up); a quantized split needs the spec's row blocks not to
straddle the gate/up boundary (:func:`row_block`). :func:`fuse` is the way back for importers: the
per-expert leaves of a checkpoint (ours or another tool's) stacked into our tree's paths, gate and up rows
concatenated. Experts stored transposed (``(experts, in, out)``, GPT-OSS) and model types whose family row
(``bridge.arch.ARCHS``) has no ``checkpoint_experts`` have no per-expert form here and are refused by path
(:func:`refusal`).
"""

from __future__ import annotations

import re
from typing import Iterator, NamedTuple

import torch
from torch import nn

import qtransform as qt

from ..arch import ExpertNames, arch_for
from ..arch import families
from ..checkpoint.metadata import CheckpointError, Entry
from ..modules.experts import expert_weights, is_experts

__all__ = ["Naming", "namings", "ExpertsInfo", "experts_modules", "routers", "naming_of", "export_name", "import_name",
           "refusal", "pieces", "row_block", "take_rows", "cat_rows", "fuse", "ignore_pattern", "site_weight",
           "input_pieces", "fuse_inputs"]


#: How one model type's original checkpoints name a layer's experts: its family row's ``checkpoint_experts``.
Naming = ExpertNames


def namings() -> dict[str, Naming]:
    """``{model type: Naming}`` of the families whose row names their checkpoints' experts (``bridge.arch.ARCHS``).

    >>> namings()["mixtral"]
    ExpertNames(gate='w1', up='w3', down='w2', moe='block_sparse_moe')
    """
    return {t: a.checkpoint_experts for a in families.ARCHS if a.checkpoint_experts for t in a.model_types}
#: vLLM's names of a FusedMoE layer's unfused projections (what its compressed-tensors loader matches targets with).
_VLLM = ("gate_proj", "up_proj", "down_proj")


class ExpertsInfo(NamedTuple):
    """One experts module of the model: its stacked weights' names and layout flags."""

    weights: tuple[str, ...]
    transposed: bool
    has_bias: bool


def experts_modules(model: nn.Module) -> dict[str, ExpertsInfo]:
    """``{module name: ExpertsInfo}`` of the experts modules of ``model`` (a ``meta``-device skeleton will do)."""
    return {n: ExpertsInfo(expert_weights(m), bool(getattr(m, "is_transposed", False)),
                           bool(getattr(m, "has_bias", False)))
            for n, m in model.named_modules() if is_experts(m)}


def routers(model: nn.Module) -> list[str]:
    """Module names of the routers beside each experts module: siblings whose 2-D ``weight`` scores the experts (one
    row per expert) or gates a shared expert (one row); transformers 5's are ``nn.Linear`` or a router class."""
    out = []
    for name, m in model.named_modules():
        if not is_experts(m) or "." not in name:
            continue
        parent = name.rpartition(".")[0]
        count = getattr(m, "num_experts", None)
        for child, c in model.get_submodule(parent).named_children():
            w = getattr(c, "weight", None)
            if c is not m and isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] in (count, 1):
                out.append(f"{parent}.{child}")
    return out


def naming_of(config: dict) -> Naming | None:
    """The :class:`Naming` of a ``config.json``'s model type (its row's ``checkpoint_experts``), ``None`` when none
    is known."""
    kind = config.get("model_type")
    arch = arch_for(kind) if isinstance(kind, str) else None
    return None if arch is None else arch.checkpoint_experts


_LAYER_MLP = re.compile(r"^(.*\.layers\.\d+)\.mlp\.")


def export_name(path: str, naming: Naming | None) -> str:
    """Our tree path (or module name) as the checkpoint names it (Mixtral: ``layers.N.mlp.`` -> ``layers.N.
    block_sparse_moe.``).

    >>> export_name("model.layers.3.mlp.gate.weight", namings()["mixtral"])
    'model.layers.3.block_sparse_moe.gate.weight'
    """
    if naming is None or naming.moe == "mlp":
        return path
    return _LAYER_MLP.sub(lambda m: f"{m.group(1)}.{naming.moe}.", path, count=1)


def import_name(name: str, naming: Naming | None) -> str:
    """Inverse of :func:`export_name`."""
    if naming is None or naming.moe == "mlp":
        return name
    return re.sub(rf"^(.*\.layers\.\d+)\.{re.escape(naming.moe)}\.", r"\1.mlp.", name, count=1)


def _projections(weight: str, naming: Naming) -> tuple[str, ...]:
    """The checkpoint projections a stacked weight holds, in row order."""
    return {"gate_up_proj": (naming.gate, naming.up), "up_proj": (naming.up,), "down_proj": (naming.down,)}[weight]


def row_block(spec: qt.QuantSpec) -> int | None:
    """Rows one scale of a 2-D ``spec`` covers (``None``: one scale row for all rows, e.g. per tensor).

    >>> row_block(qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))), row_block(qt.QuantSpec(format="fp8_e4m3"))
    (1, None)
    """
    g = spec.granularity
    if isinstance(g, qt.PerTensor) or (isinstance(g, qt.PerChannel) and g.axis in (1, -1)):
        return None
    if isinstance(g, qt.PerChannel):
        return 1
    if isinstance(g, qt.PerGroup):
        return g.size if g.axis in (0, -2) else 1
    if isinstance(g, qt.PerBlock):
        return g.shape[0]
    raise ValueError(f"row_block: granularity {g} of {spec} is not a matrix granularity")


def refusal(path: str, info: ExpertsInfo, naming: Naming | None, spec: qt.QuantSpec | None, shape, *,
            target: str) -> str | None:
    """Why the stacked weight ``path`` (``spec`` ``None``: float) cannot be written per expert, or ``None``."""
    if info.transposed:
        return (f"{path}: experts stored transposed (experts, in, out) (GPT-OSS): {target} has no per-expert form "
                "for them here")
    if info.has_bias:
        return f"{path}: experts with biases: {target} export writes per-expert weights without biases only"
    if naming is None:
        return (f"{path}: mixture-of-experts weights of this model type: {target} export knows per-expert names "
                f"for the model types {sorted(namings())} only")
    if spec is not None and path.endswith(".gate_up_proj"):
        m = qt.matrix_spec(spec, tuple(shape))
        block, half = row_block(m), shape[1] // 2
        if shape[1] % 2 or (block is not None and half % block):
            return (f"{path}: {spec}: scale blocks of {block} rows straddle the gate/up boundary at row {half} of "
                    f"{shape[1]}; {target} stores gate and up as separate tensors")
    return None


def take_rows(leaf, start: int, stop: int, *, where: str):
    """Rows ``start:stop`` of a 2-D tensor or QTensor (a view: codes and the scale rows covering them)."""
    if not isinstance(leaf, qt.QTensor):
        return leaf[start:stop]
    rows, block = leaf.shape[0], row_block(leaf.spec)
    if block is not None and (start % block or (stop % block and stop != rows)):
        raise ValueError(f"{where}: rows {start}:{stop} cut scale blocks of {block} rows")
    fields = {}
    for k, t in leaf.qparams.tensors().items():
        if block is None or t.dim() == 0:  # one scale row for all rows, or a scalar (NVFP4's tensor scale)
            fields[k] = t
        else:
            fields[k] = t[start // block: -(-stop // block)]
    return qt.QTensor(codes=leaf.codes[start:stop], qparams=qt.QParams(spec=leaf.spec, **fields), width=leaf.width,
                      dtype=leaf.dtype)


def cat_rows(parts: list, *, where: str):
    """The rows of ``parts`` (2-D tensors, or QTensors of one spec) one after the other."""
    if not all(isinstance(p, qt.QTensor) for p in parts):
        if any(isinstance(p, qt.QTensor) for p in parts):
            raise CheckpointError(f"{where}: gate and up of one expert are not both quantized (or both float)")
        return torch.cat(parts, 0)
    first = parts[0]
    if any(p.spec != first.spec or p.width != first.width or p.dtype != first.dtype for p in parts):
        raise CheckpointError(f"{where}: gate and up of one expert differ in spec ({[str(p.spec) for p in parts]}); "
                              "a fused gate_up_proj holds one")
    block = row_block(first.spec)
    fields = {}
    for k, t in first.qparams.tensors().items():
        ts = [p.qparams.tensors()[k] for p in parts]
        if block is None or t.dim() == 0:
            if any(not torch.equal(x, t) for x in ts):
                raise CheckpointError(f"{where}: gate and up of one expert have different {k}s under {first.spec} "
                                      "(one for the whole matrix); a fused gate_up_proj holds one")
            fields[k] = t
        else:
            fields[k] = torch.cat(ts, 0)
    return qt.QTensor(codes=torch.cat([p.codes for p in parts], 0), qparams=qt.QParams(spec=first.spec, **fields),
                      width=first.width, dtype=first.dtype)


def pieces(path: str, leaf, naming: Naming) -> Iterator[tuple[str, object]]:
    """``(checkpoint module name, 2-D leaf)`` per expert and projection of the stacked weight ``path`` (views;
    gate rows then up rows of a fused ``gate_up_proj``), e.g. ``("model.layers.0.mlp.experts.3.gate_proj", q)``."""
    module, _, weight = path.rpartition(".")
    names = _projections(weight, naming)
    base = export_name(module, naming)
    rows = leaf.shape[1] // len(names)
    for e in range(leaf.shape[0]):
        m = qt.stacked.matrix(leaf, e) if isinstance(leaf, qt.QTensor) else leaf[e]
        for i, proj in enumerate(names):
            part = m if len(names) == 1 else take_rows(m, i * rows, (i + 1) * rows, where=path)
            yield f"{base}.{e}.{proj}", part


def ignore_pattern(module: str, naming: Naming | None) -> str:
    """A compressed-tensors ``re:`` target of every per-expert projection of the experts ``module`` (checkpoint
    name), in the checkpoint's names and in vLLM's (``<experts>.0.gate_proj``, which its fused-MoE loader matches).

    >>> ignore_pattern("model.layers.0.block_sparse_moe.experts", namings()["mixtral"])
    're:^model\\\\.layers\\\\.0\\\\.block_sparse_moe\\\\.experts\\\\.\\\\d+\\\\.(down_proj|gate_proj|up_proj|w1|w2|w3)$'
    """
    own = () if naming is None else (naming.gate, naming.up, naming.down)
    names = "|".join(sorted({*own, *_VLLM}))
    return rf"re:^{re.escape(module)}\.\d+\.({names})$"


_PIECE = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight$")


def fuse(tree: dict, entries: dict, config: dict, *, where) -> tuple[dict, dict]:
    """An imported tree with per-expert weights (checkpoint names) as our tree: ``(tree, entries)`` with each
    experts module's ``<e>.<gate>.weight``/``<up>``/``<down>`` leaves stacked into ``gate_up_proj`` (gate rows
    then up rows) and ``down_proj``, and every path renamed back (:func:`import_name`). Trees without per-expert
    names come back unchanged. :class:`CheckpointError` naming ``where`` for missing experts or projections."""
    naming = naming_of(config)
    if naming is None:
        return tree, entries
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for name in tree:
        m = _PIECE.match(name)
        if m and m["proj"] in (naming.gate, naming.up, naming.down):
            groups.setdefault(m["module"], {}).setdefault(int(m["e"]), {})[m["proj"]] = name
    out_tree = {import_name(n, naming): t for n, t in tree.items()}
    out_entries = {import_name(n, naming): e for n, e in entries.items()}
    for module, experts in sorted(groups.items()):
        ours = import_name(module, naming)
        count = max(experts) + 1
        if sorted(experts) != list(range(count)):
            raise CheckpointError(f"{where}: {module}: experts {sorted(set(range(count)) - set(experts))} missing")
        gated = any(naming.gate in p for p in experts.values())
        for weight, projs in (("gate_up_proj" if gated else "up_proj", (naming.gate, naming.up) if gated
                               else (naming.up,)), ("down_proj", (naming.down,))):
            mats = []
            for e in range(count):
                lacking = [p for p in projs if p not in experts[e]]
                if lacking:
                    raise CheckpointError(f"{where}: {module}.{e}: no {lacking} weight")
                names = [experts[e][p] for p in projs]
                parts = [out_tree.pop(import_name(n, naming)) for n in names]
                for n in names:
                    out_entries.pop(import_name(n, naming), None)
                mats.append(cat_rows(parts, where=f"{where}: {module}.{e}") if len(parts) > 1 else parts[0])
            quantized = [isinstance(x, qt.QTensor) for x in mats]
            if any(quantized) and not all(quantized):
                raise CheckpointError(f"{where}: {module}: some experts' {projs} are quantized, others are not")
            if all(quantized):
                try:
                    stacked = qt.stacked.stack(mats)
                except ValueError as e:
                    raise CheckpointError(f"{where}: {module}: {e}") from None
                out_entries[f"{ours}.{weight}"] = Entry(stacked.spec, tuple(stacked.shape), stacked.dtype)
            else:
                stacked = torch.stack(mats)
            out_tree[f"{ours}.{weight}"] = stacked
    return out_tree, out_entries


def site_weight(site_module: str, experts) -> tuple[str, str] | None:
    """``(experts module, weight name)`` of an activation site on a stacked experts weight
    (``Site("<experts>.gate_up_proj", "input")``), ``None`` for other sites; ``experts``: the experts modules."""
    module, _, weight = site_module.rpartition(".")
    return (module, weight) if module in experts and weight in ("gate_up_proj", "up_proj", "down_proj") else None


def input_pieces(site_module: str, count: int, naming: Naming) -> list[str]:
    """The per-expert checkpoint modules (``<experts>.{e}.gate_proj``...) whose inputs are the input of our stacked
    projection ``site_module``: one static scale of ours is every one of theirs (vLLM reads one per expert)."""
    module, _, weight = site_module.rpartition(".")
    base = export_name(module, naming)
    return [f"{base}.{e}.{proj}" for e in range(count) for proj in _projections(weight, naming)]


_PIECE_MODULE = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")


def fuse_inputs(tree: dict, activations: dict, config: dict, *, prefixes: dict, where) -> tuple[dict, dict]:
    """The per-expert activation quantizers of an imported checkpoint (sites on ``<experts>.{e}.<proj>``, checkpoint
    names, their tensors already renamed by :func:`fuse`) as ours: one site per stacked projection
    (``<experts>.gate_up_proj``), its tensors ``<experts>.gate_up_proj_input_scale``... (``prefixes``: role ->
    tensor prefix). Every expert must hold the same spec and values (one quantizer is what ``QExperts`` holds):
    :class:`CheckpointError` naming the first that differs."""
    naming = naming_of(config)
    if naming is None:
        return tree, activations
    groups: dict[tuple, list] = {}
    for site in activations:
        m = _PIECE_MODULE.match(import_name(site.module, naming))
        if m is None or m["proj"] not in (naming.gate, naming.up, naming.down):
            continue
        ours = m["module"]
        weight = "down_proj" if m["proj"] == naming.down else \
            "gate_up_proj" if f"{ours}.gate_up_proj" in tree else "up_proj"
        groups.setdefault((ours, weight, site.role), []).append(site)
    tree, activations = dict(tree), dict(activations)
    for (ours, weight, role), sites in sorted(groups.items()):
        first = sites[0]
        spec = activations[first]
        for site in sites:
            if activations[site] != spec:
                raise CheckpointError(f"{where}: {site.module}:{role} is {activations[site]}, {first.module}:{role} is "
                                      f"{spec}: one {role} quantizer per projection of {ours} is what qtransform holds")
        for f in qt.QParams.FIELDS:
            names = [import_name(f"{s.module}.{prefixes[role]}{f}", naming) for s in sites]
            held = [n for n in names if n in tree]
            if not held:
                continue
            if len(held) != len(names):
                raise CheckpointError(f"{where}: {sorted(set(names) - set(held))[0]} is missing beside {held[0]}")
            value = tree[held[0]]
            for n in held:
                if not torch.equal(tree[n], value):
                    raise CheckpointError(f"{where}: {n} ({tree[n].flatten().tolist()}) differs from {held[0]} "
                                          f"({value.flatten().tolist()}): qtransform's experts hold one static {role} "
                                          f"{f} per projection, vLLM one per expert")
            for n in held:
                del tree[n]
            tree[f"{ours}.{weight}_{prefixes[role]}{f}"] = value
        for site in sites:
            del activations[site]
        activations[qt.Site(f"{ours}.{weight}", role)] = spec
    return tree, activations
