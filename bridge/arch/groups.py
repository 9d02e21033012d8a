"""A model's smoothing groups from its family's row (:mod:`.families`): a model fact ``bridge.plan`` puts on the plan.

:func:`find_arch` recognises the family by ``config.model_type``, else by structure (the blocks and
every module a table names, with norm classes that fold); :func:`smoothing_groups` resolves the
table for every block into the plain dicts that ``qtransform.algorithms.smoothing`` reads;
:func:`bridge.plan` puts them on the plan (``Plan.groups``, ``None`` for a model without a table: see
:func:`model_groups`), where ``smoothquant``, ``awq`` and ``gptq`` read them.

>>> import transformers as tf
>>> m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=4, num_key_value_heads=2))
>>> find_arch(m).name, [g["prev"] for g in smoothing_groups(m)][:2]
('llama', ['model.layers.0.input_layernorm', 'model.layers.0.self_attn.v_proj'])
>>> smoothing_groups(m)[1]
{'prev': 'model.layers.0.self_attn.v_proj', 'linears': ['model.layers.0.self_attn.o_proj'], 'head_dim': 4}
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from ..modules.experts import expert_weights
from ..tree import stored_transposed
from . import families
from .tables import Arch, GroupTemplate

__all__ = ["find_arch", "smoothing_groups", "model_groups"]

KINDS = ("norm", "linear")


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or stored_transposed(m)


def _is_router(m: nn.Module) -> bool:
    """A float linear reading the MLP's input: an ``nn.Linear`` or a router module with a 2-D ``weight``."""
    w = getattr(m, "weight", None)
    return isinstance(m, nn.Linear) or (isinstance(w, nn.Parameter) and w.dim() == 2 and not _is_linear(m))


def _stacked(model: nn.Module, path: str) -> nn.Module | None:
    """The experts module holding the stacked weight at ``path`` (``None``: not one)."""
    parent, _, leaf = path.rpartition(".")
    m = _module(model, parent)
    return m if m is not None and leaf in expert_weights(m) else None


def _applies(model: nn.Module, block: str, t: GroupTemplate) -> bool:
    """Whether the block has the group (``present``: the module it needs exists)."""
    return t.present is None or _module(model, f"{block}.{t.present}") is not None


def _missing(model: nn.Module, arch: Arch) -> str | None:
    """Why ``arch`` does not fit ``model`` (``None``: it fits)."""
    cfg = getattr(model, "config", None)
    for name, value in arch.requires:
        if getattr(cfg, name, None) != value:
            return f"config.{name} must be {value!r} (got {getattr(cfg, name, None)!r})"
    blocks = _module(model, arch.blocks)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        return f"no module list {arch.blocks!r}"
    applied = 0
    for t in arch.groups:
        first = next((f"{arch.blocks}.{i}" for i in range(len(blocks)) if _applies(model, f"{arch.blocks}.{i}", t)),
                     None)
        if first is None:  # e.g. dense MLP groups of a model whose every block has experts
            continue
        applied += 1
        for rel in (t.prev, *t.linears):
            if rel in t.stacked:
                if _stacked(model, f"{first}.{rel}") is None:
                    return f"{first}.{rel} is not a stacked weight of an experts module"
                continue
            m = _module(model, f"{first}.{rel}")
            if m is None:
                return f"no module {first}.{rel}"
            if rel in t.routers and not _is_router(m):
                return f"{first}.{rel} is a {type(m).__name__}, not a router (a module with a 2-D weight)"
            if rel in t.linears and rel not in t.routers and not _is_linear(m):
                return f"{first}.{rel} is a {type(m).__name__}, not a linear layer"
        prev = _module(model, f"{first}.{t.prev}")
        foldable = families.foldable_norms()
        if not _is_linear(prev) and type(prev).__name__ not in foldable:
            return (f"{first}.{t.prev} is a {type(prev).__name__}, not a norm known to fold a scale "
                    f"({sorted(foldable)})")
        if not _is_linear(prev) and getattr(prev, "weight", None) is None:
            return f"{first}.{t.prev} has no weight (elementwise_affine=False) to fold a scale into"
    if not applied:  # a row whose every group needs a module the blocks lack
        return f"no block of {arch.blocks!r} has the modules of its groups ({arch.groups[0].present}...)"
    return None


def find_arch(model: nn.Module) -> Arch:
    """The row of ``model``'s family (:data:`~.families.ARCHS`, the rows with smoothing groups): by
    ``config.model_type``, else the first row whose structure fits.

    ``ValueError`` naming the model type and, per row, what is missing, for an unsupported model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    tables = [a for a in families.ARCHS if a.groups]
    named = [a for a in tables if model_type in a.model_types]
    for arch in named or tables:
        if _missing(model, arch) is None:
            return arch
    why = "; ".join(f"{a.name}: {_missing(model, a)}" for a in (named or tables))
    raise ValueError(f"smoothing groups: no architecture table fits {type(model).__name__} (model_type "
                     f"{model_type!r}); supported: {sorted({t for a in tables for t in a.model_types})}. "
                     f"What is missing: {why}")


def _head_dim(model: nn.Module, attn: nn.Module | None) -> int:
    d = getattr(attn, "head_dim", None)
    cfg = getattr(model, "config", None)
    if not isinstance(d, int):
        d = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // max(getattr(
            cfg, "num_attention_heads", 1) or 1, 1))
    if not isinstance(d, int) or d < 1:
        raise ValueError(f"smoothing groups: cannot tell the attention head size of {type(model).__name__} "
                         "(no head_dim on the attention module or the config)")
    return d


def _rows(kind: str, prev: nn.Module, reader: nn.Module, where: str) -> list[int]:
    w = prev.weight.T if stored_transposed(prev) else prev.weight
    r = reader.weight.T if stored_transposed(reader) else reader.weight
    out, n_q = w.shape[0], r.shape[1]
    if kind == "v":
        kv = (out - n_q) // 2
        if kv <= 0 or n_q + 2 * kv != out:
            raise ValueError(f"{where}: a fused [q; k; v] of {out} outputs does not fit an output projection "
                             f"reading {n_q}")
        return [out - kv, out]
    if kind == "up":
        if out % 2:
            raise ValueError(f"{where}: a fused [gate; up] needs an even number of outputs, got {out}")
        return [out // 2, out]
    raise ValueError(f"{where}: unknown rows kind {kind!r}")


def _resolve(model: nn.Module, block: str, t: GroupTemplate) -> dict:
    prev = model.get_submodule(f"{block}.{t.prev}")
    linears = [f"{block}.{rel}" for rel in t.linears]
    layouts = {stored_transposed(model.get_submodule(f"{block}.{rel}")) for rel in t.linears if rel not in t.stacked}
    layouts |= {stored_transposed(prev)} if _is_linear(prev) else set()
    experts = {bool(_stacked(model, f"{block}.{rel}").is_transposed) for rel in t.stacked}  # their own layout
    if len(layouts) != 1:
        raise ValueError(f"{block}.{t.prev}: the group mixes weights stored (out, in) and (in, out)")
    g: dict = {"prev": f"{block}.{t.prev}", "linears": linears}
    if t.rows is not None:
        g["rows"] = _rows(t.rows, prev, model.get_submodule(linears[0]), f"{block}.{t.prev}")
    if t.heads:
        g["head_dim"] = _head_dim(model, _module(model, f"{block}.{t.prev}".rpartition(".")[0]))
    if layouts == {True}:
        g["transposed"] = True
    if len(experts) > 1:
        raise ValueError(f"{block}.{t.prev}: the group's experts weights mix (experts, out, in) and (experts, in, out)")
    if experts == {True}:
        g["stacked_transposed"] = True
    if t.inspect is not None:
        g["inspect"] = f"{block}.{t.inspect}"
        if t.local:
            g["local"] = True
    for key in ("stacked", "routers"):
        if getattr(t, key):
            g[key] = [f"{block}.{rel}" for rel in getattr(t, key)]
    return g


def smoothing_groups(model: nn.Module, *, kinds: Iterable[str] = KINDS) -> list[dict]:
    """``model``'s smoothing groups, block by block in table order, as plain dicts
    (``{"prev", "linears", "rows"?, "head_dim"?, "transposed"?, "inspect"?, "local"?, "stacked"?, "routers"?}``:
    ``Plan.groups``); a block gets the groups whose ``present`` module it has (dense or experts MLP).

    ``kinds``: ``"norm"`` (a norm feeds the linears) and/or ``"linear"`` (a linear's output: v -> o,
    up -> down, fc1 -> fc2). ``ValueError`` for an unsupported architecture (see :func:`find_arch`).
    """
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"smoothing_groups: kinds must be some of {list(KINDS)}, got {list(kinds)}")
    arch = find_arch(model)
    cfg = getattr(model, "config", None)
    out = []
    for i in range(len(model.get_submodule(arch.blocks))):
        block = f"{arch.blocks}.{i}"
        for t in arch.groups:
            if t.when is not None and getattr(cfg, t.when[0], None) not in t.when[1]:
                continue
            if not _applies(model, block, t):
                continue
            kind = "linear" if _is_linear(model.get_submodule(f"{block}.{t.prev}")) else "norm"
            if kind in kinds:
                out.append(_resolve(model, block, t))
    return out


def model_groups(model: nn.Module) -> list[dict] | None:
    """``model``'s smoothing groups (:func:`smoothing_groups`), or ``None`` when no architecture table
    fits it (the steps that need them say so, naming the model; the others run without)."""
    try:
        return smoothing_groups(model)
    except ValueError:
        return None
