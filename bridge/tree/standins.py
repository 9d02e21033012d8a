"""Linear layers whose weight a module above them reads directly: a ``QLinear`` cannot stand in for them.

A ``QLinear`` replaces an ``nn.Linear`` that its parent *calls* (``module(x)``); its ``weight`` buffer holds the
packed integer codes. Some models read a linear layer's weight as a tensor instead:

* Mamba's mixer: ``self.dt_proj.weight @ time_step`` (and, with the CUDA kernels, every projection's weight);
* RWKV's model rescales ``block.attention.output.weight`` and ``block.feed_forward.value.weight`` in place as it
  switches between training and inference.

Quantized, such a read gets the codes: a shape error at best, wrong numbers at worst. :func:`direct_reads` finds
those weights from the source of the methods of the modules above them (initialisation excluded; reads of the
weight's ``dtype`` and ``device`` are the pipeline's own rule, :func:`bridge.pipeline.plan`), and
:func:`keep_read_weights` keeps them in float where a type rule or the default would quantize them, with the
reason in the plan, and refuses a glob rule that selects one (``ValueError`` naming the path and the reader).

>>> import torch
>>> class Mixer(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.dt_proj = torch.nn.Linear(4, 4)
...     def forward(self, x):
...         return self.dt_proj.weight @ x
>>> direct_reads(torch.nn.Sequential(Mixer()))
{'0.dt_proj.weight': 'Mixer.forward reads dt_proj.weight directly'}
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Mapping

from torch import nn

import qtransform as qt

__all__ = ["direct_reads", "keep_read_weights"]

#: methods that set weights up rather than compute with them
_INIT = {"__init__", "_init_weights", "init_weights", "_initialize_weights", "post_init", "tie_weights",
         "_tie_weights", "_tie_or_clone_weights", "reset_parameters", "extra_repr"}
#: attributes of a weight that a quantized module's codes answer as the float weight would (or that the pipeline's
#: own rule covers: ``dtype``)
_HARMLESS = {"dtype", "device", "is_meta", "requires_grad"}
#: conditions under which a branch never runs when a quantized model infers: training, tensor-parallel slicing
_NOT_INFERENCE = ("training", "pretraining_tp")
_reads_of: dict[type, dict[str, str]] = {}


def _chain(node) -> list[str] | None:
    """``["self", "dt_proj", "weight"]`` for ``self.dt_proj.weight`` (``None`` for anything but names and dots)."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    return [node.id, *out[::-1]] if isinstance(node, ast.Name) else None


def _not_inference(test) -> bool:
    """Whether branch condition ``test`` holds only in training or tensor-parallel runs (``self.training``,
    ``self.training and ...``, ``self.pretraining_tp > 1 and ...``)."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    for part in parts:
        if isinstance(part, ast.Compare):
            part = part.left
        chain = _chain(part)
        if chain and chain[-1] in _NOT_INFERENCE:
            return True
    return False


def _weight_reads(tree) -> list[str]:
    """The ``<child>`` / ``<child>.<grandchild>`` of each ``<...>.<child>.weight`` read in ``tree`` as a tensor,
    outside branches that run only in training (see :func:`_not_inference`)."""
    found, skip = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _not_inference(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        if isinstance(node, ast.Attribute) and node.attr in _HARMLESS:
            skip.add(id(node.value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            skip.update(id(a) for a in node.args[:1])  # T5's isinstance(self.wo.weight, torch.Tensor)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "weight" and id(node) not in skip:
            chain = _chain(node)
            if chain and len(chain) >= 3:
                found.append(".".join(chain[-3:-1] if len(chain) >= 4 else chain[-2:-1]))
    return found


def _reads(cls: type) -> dict[str, str]:
    """``{"<child>" or "<child>.<grandchild>": "Class.method"}``: the weights the methods of ``cls`` read."""
    if cls not in _reads_of:
        found: dict[str, str] = {}
        for klass in cls.__mro__:
            if klass.__module__.startswith(("torch.", "transformers.modeling_utils", "transformers.generation")):
                continue
            for name, fn in vars(klass).items():
                if name in _INIT or "init" in name or not inspect.isfunction(fn):  # init_mamba_weights too
                    continue
                try:
                    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
                except (OSError, TypeError, SyntaxError):
                    continue
                for ref in _weight_reads(tree):
                    found.setdefault(ref, f"{klass.__name__}.{name}")
        _reads_of[cls] = found
    return _reads_of[cls]


def direct_reads(model: nn.Module) -> dict[str, str]:
    """``{weight path: why}`` for the ``nn.Linear`` layers of ``model`` whose weight a module above them reads
    directly (the nearest such module names it)."""
    modules = dict(model.named_modules())
    out = {}
    for path, m in modules.items():
        if type(m) is not nn.Linear or not path:
            continue
        parts = path.split(".")
        for i in range(len(parts) - 1, -1, -1):  # the modules above, nearest first
            rel = [p for p in parts[i:] if not p.isdigit()]  # "blocks.3.attention.output": attention.output
            if not rel:
                continue
            reads = _reads(type(modules[".".join(parts[:i])]))
            key = ".".join(rel[-2:])
            where = reads.get(key) if len(rel) > 1 else reads.get(rel[0])
            if where is not None:
                out[f"{path}.weight"] = f"{where} reads {key}.weight directly"
                break
    return out


def keep_read_weights(model: nn.Module, recipe: qt.Recipe, matches: Mapping[str, qt.Match],
                      tree: Mapping) -> dict[str, qt.Match]:
    """``{path: Match}`` for the weights of :func:`direct_reads` that a type rule or the default would quantize:
    kept in float, said why. ``ValueError`` where a glob rule (``rules[...]``) selects one."""
    out = {}
    for path, why in direct_reads(model).items():
        m = matches.get(path)
        if m is None or m.spec is None:
            continue
        if m.rule.startswith("rules["):
            raise ValueError(f"{path}: recipe {m.rule} selects a weight that {why}: a quantized module stores integer "
                             "codes there; keep it in float")
        out[path] = qt.Match(None, f"skipped ({why}: a quantized module would give it the codes; kept in float)",
                             m.module_type)
    return out
