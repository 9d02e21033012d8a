"""The checks of the walk over every model type (issue 51, part 6), one function each, and the family kind of a
model for the report. Each check raises ``AssertionError`` on a failure and returns what it found (``"quantized"``,
``"refused: <message>"``), which the tests record (``record_property("outcome", ...)``)."""

from __future__ import annotations

import copy
import re

import torch
from safetensors.torch import load_file
from torch import nn

import bridge
import qtransform as qt

#: the family kinds of the report, the first that fits a model wins
KINDS = ("vlm", "mamba-hybrid", "linear-attention", "moe", "sliding-window", "dense")

_MAMBA = re.compile(r"Mamba|SSM|Mixer$")
_LINEAR = re.compile(r"GatedDeltaNet|DeltaNet|LinearAttention|ShortConv|Rwkv|xLSTM|Mlstm|Recurrent|Lightning|Kda|"
                     r"RecurrentBlock|Rglru|Retention", re.I)
_MOE = re.compile(r"Expert|MoE|Moe|SparseMlp|Router", re.I)


def family(entry, model: nn.Module) -> str:
    """The model's family kind (one of :data:`KINDS`), from its mapping, towers and module classes."""
    names = {type(m).__name__ for m in model.modules()}
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if entry.mapping == "vlm" or bridge.arch.towers(model):
        return "vlm"
    ssm = any({"A_log", "D"} <= set(m._parameters) for m in model.modules())  # Mamba's state-space parameters
    if ssm or any(_MAMBA.search(n) for n in names):
        return "mamba-hybrid"
    if any(_LINEAR.search(n) for n in names):
        return "linear-attention"
    if any(_MOE.search(n) for n in names) or bridge.tree.unsupported_experts(model):
        return "moe"
    types = getattr(config, "layer_types", None) or ()
    if getattr(config, "sliding_window", None) or any("sliding" in str(t) for t in types):
        return "sliding-window"
    return "dense"


def named(message: str, model: nn.Module, *extra: str) -> bool:
    """Whether a refusal ``message`` names what it refuses: a tensor or module path of ``model``, its class, or
    one of ``extra`` (a step name)."""
    words = {type(model).__name__, *extra}
    words |= {p for p in model.state_dict()} | {n for n, _ in model.named_modules() if n}
    return any(w and w in message for w in words)


def _deliberate(match, module: nn.Module | None, name: str) -> bool:
    """A float tensor the plan keeps on purpose: a rule that says so ('skipped (...)', excluded, a rule or type
    rule given None), or no rule for a tensor that is not the weight of a linear layer."""
    rule = match.rule
    if rule.startswith(("skipped", "exclude[")) or (rule.startswith(("rules[", "type_rules[")) and match.spec is None):
        return True
    if rule == "no rule":  # a linear layer's bias falls under min_ndim (a subclass has no type rule to say so)
        return not isinstance(module, nn.Linear) or match.module_type == "Router" or not name == "weight"
    return False


def check_inventory(model: nn.Module, qmodel: nn.Module, plan) -> list[str]:
    """(a) Every tensor of the float model's state dict is a QTensor of ``bridge.extract(qmodel)`` or kept in float
    (unchanged) with a deliberate plan rule; an ``nn.Linear`` subclass's weight kept by no rule is a failure.
    Returns the rules that kept tensors in float, for the record."""
    qtree = bridge.extract(qmodel)
    float_sd = model.state_dict()
    dropped = [p for p in float_sd if p not in qtree]
    assert not dropped, f"tensors of the float model missing from the quantized one: {dropped[:5]}"
    silent, planned, changed, kept = [], [], [], set()
    for path, t in float_sd.items():
        v = qtree[path]
        if isinstance(v, qt.QTensor):
            continue
        m = plan[path]
        if m.spec is not None:
            planned.append(path)
            continue
        owner = qt.module_of(path)
        module = model.get_submodule(owner) if owner else model
        if not _deliberate(m, module, path.rpartition(".")[2]):
            silent.append(f"{path} ({type(module).__name__}, a subclass of nn.Linear: {m.rule})")
        kept.add(m.rule)
        if not torch.equal(v, t):
            changed.append(path)
    assert not planned, f"planned to be quantized but left in float: {planned[:5]}"
    assert not silent, f"linear weights left in float with no rule naming them: {silent[:5]}"
    assert not changed, f"tensors kept in float but changed: {changed[:5]}"
    assert any(isinstance(v, qt.QTensor) for v in qtree.values()), "nothing quantized"
    return sorted(kept)


def dequantized_copy(model: nn.Module, qmodel: nn.Module) -> nn.Module:
    """A deep copy of the float model with each quantized weight replaced by its dequantized QTensor: a new
    parameter, so that a tensor tied to it (an input embedding the recipe keeps) stays as the quantized model
    keeps it."""
    ref = copy.deepcopy(model)
    for path, v in bridge.extract(qmodel).items():
        if isinstance(v, qt.QTensor):
            owner, _, name = path.rpartition(".")
            module = ref.get_submodule(owner)
            old = getattr(module, name)
            setattr(module, name, nn.Parameter(qt.dequantize(v).to(old.dtype), requires_grad=False))
    return ref


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)  # a model that draws noise in its forward (none should) draws the same
    with torch.no_grad():
        return model(input_ids=ids).logits


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within float32 noise: the same matrices multiplied by different (dequantizing) code."""
    assert torch.isfinite(want).all(), "the reference logits are not finite"
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(scale, 1.0))


def safetensors_of(directory) -> dict:
    return {n: t for f in sorted(directory.glob("*.safetensors")) for n, t in load_file(f).items()}


def same_tensors(a: dict, b: dict) -> None:
    """The same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b))[:5])
    differ = [n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]
    assert not differ, f"{len(differ)} tensors differ: {differ[:5]}"


def same_trees(got: dict, want: dict) -> None:
    """The same paths, each QTensor dequantizing to the same values and each float tensor equal."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))[:5]
    value = lambda v: qt.dequantize(v) if isinstance(v, qt.QTensor) else v  # noqa: E731
    kinds = [p for p in want if isinstance(got[p], qt.QTensor) != isinstance(want[p], qt.QTensor)]
    assert not kinds, f"quantized in one, float in the other: {kinds[:5]}"
    differ = [p for p in want if not torch.equal(value(got[p]), value(want[p]))]
    assert not differ, f"{len(differ)} tensors differ: {differ[:5]}"


def quantized(w, record_property) -> bool:
    """Whether walked model ``w`` (``error``, ``qmodel``, ``refusal``, ``model``) was quantized; False: refused by
    name (checked here, recorded); a crash is raised."""
    if w.error is not None:
        raise w.error
    if w.qmodel is None:
        assert named(w.refusal, w.model), f"refused without naming a tensor, module or the model: {w.refusal}"
        record_property("outcome", f"refused: {w.refusal}")
        return False
    return True
