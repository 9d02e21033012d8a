"""How much memory a run will hold, estimated before anything is loaded (from ``config.json``'s skeleton, the
plan and the calibration size), and how much this machine has.

The rules are docs/streaming.md's ("Memory"), with the factors measured there (``/usr/bin/time -v`` on
SmolLM2-135M, TinyLlama-1.1B and Llama-3-8B shapes):

- **in memory**: the Python process (0.5 GB) + the model in float32 (what the command loads) times 1.7
  without calibration (the quantized tree, the modules rebuilt, the stored copy written: 1.63 measured) or
  2.4 with it (Hessians, activations, the float outputs of a block: 2.2-2.4 measured);
- **shard to shard**: the process + 5 times the largest quantized tensor in float32 (read ahead, the float
  copy, the quantization's temporaries, write behind; tensors stored unchanged are copied in chunks);
- **block by block**: the process + the larger of (one decoder block in float32 four times over, the widest
  input's Hessian in float64 three times over, per expert for stacked experts) and (the largest tensor outside
  the blocks, quantized at the end as shard to shard does), + the calibration activations: one stream of
  ``tokens x hidden`` float32 per calibrated pass (at most ``max_memory`` of them: the rest spills to disk)
  and three for the block being calibrated;
- **evaluating** a model: the float32 model times 1.5, quantized or not (transformers builds the model in
  float32 before the quantized modules replace its linears: a TinyLlama-1.1B int4 checkpoint's evaluation peaks
  at 5.9 GB, the float model's at 7.3 GB), + the logits of a batch of 4 sequences (four float32 copies).

Estimates, not promises: they are meant to refuse a run that cannot fit before minutes of loading, not to
budget the last hundred megabytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import qtransform as qt
from torch import nn

from ..arch.embeddings import input_embeddings

__all__ = ["Estimate", "PROCESS", "in_memory", "streamed", "evaluation", "available", "format_size"]

#: the Python process with torch and transformers imported (0.45 GB measured)
PROCESS = 500_000_000
_EVAL_BATCH = 4


class Estimate(NamedTuple):
    """A peak estimate: ``total`` bytes and its ``parts`` (``(what, bytes)``, largest first)."""

    total: int
    parts: tuple

    @classmethod
    def of(cls, parts) -> "Estimate":
        parts = tuple(sorted(((w, int(b)) for w, b in parts if b > 0), key=lambda p: -p[1]))
        return cls(sum(b for _, b in parts), parts)

    def describe(self) -> str:
        """``"12.3 GB (the model in float32 9.1 GB, ...)"``."""
        return f"{format_size(self.total)} ({', '.join(f'{w} {format_size(b)}' for w, b in self.parts)})"


def format_size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _params(model: nn.Module):
    """The model's parameters, each once (tied ones share their object), by path."""
    return dict(model.named_parameters())


def _float32(model: nn.Module) -> int:
    return 4 * sum(p.numel() for p in _params(model).values())


def in_memory(model: nn.Module, *, calibrated: bool, seq_len: int | None = None) -> Estimate:
    """The in-memory driver's peak on ``model`` (a skeleton on ``meta`` does), evaluating on sequences of
    ``seq_len`` tokens when given."""
    f32 = _float32(model)
    return Estimate.of([("the process", PROCESS), ("the model in float32", f32),
                        ("quantizing it" + (" with calibration" if calibrated else ""), f32 * (1.4 if calibrated else 0.7)),
                        ("the logits", _logits(model, seq_len) if seq_len else 0)])


def _logits(model: nn.Module, seq_len: int) -> int:
    return 4 * 4 * _EVAL_BATCH * seq_len * int(getattr(model.config, "vocab_size", 0) or 0)


def _hidden(model: nn.Module) -> int:
    emb = input_embeddings(model)
    w = getattr(emb, "weight", None)
    return int(w.shape[-1]) if w is not None else int(getattr(model.config, "hidden_size", 0) or 0)


def streamed(model: nn.Module, plan: qt.Plan, *, block_by_block: bool, tokens: int = 0, streams: int = 1,
             max_memory: int | None = None) -> Estimate:
    """The streamed driver's peak on ``model`` (its skeleton) planned as ``plan``: shard to shard, or block by
    block with ``tokens`` calibration tokens in ``streams`` calibrated passes, ``max_memory`` of them kept."""
    from ..calibrate.blocks import find_blocks

    params = _params(model)
    blocks = find_blocks(model) if block_by_block else ()
    within = lambda path: any(path.startswith(b + ".") for b in blocks)  # noqa: E731
    quantized = {p: t for p, t in params.items() if p in plan.specs}
    one_tensor = 5 * max((4 * t.numel() for p, t in quantized.items() if not within(p)), default=0)
    parts = [("the process", PROCESS)]
    if not block_by_block:
        return Estimate.of(parts + [("the largest tensors read, quantized and written", one_tensor)])
    block = max((sum(4 * t.numel() for p, t in params.items() if p.startswith(b + ".")) for b in blocks), default=0)
    hessian = max((8 * t.shape[-1] ** 2 * (t.shape[0] if t.dim() == 3 else 1)
                   for p, t in quantized.items() if within(p) and t.dim() >= 2), default=0)
    work = max(4 * block + 3 * hessian, one_tensor)
    act = 4 * tokens * _hidden(model)
    kept_acts = streams * act if max_memory is None else min(streams * act, max_memory)
    return Estimate.of(parts + [("a block, its Hessians and copies" if work > one_tensor else
                                 "the largest tensors outside the blocks", work),
                                ("the calibration activations", kept_acts + 3 * act)])


def evaluation(model: nn.Module, *, seq_len: int) -> Estimate:
    """Evaluating ``model`` (or its quantized checkpoint) loaded whole, on sequences of ``seq_len`` tokens."""
    return Estimate.of([("the process", PROCESS), ("the model loaded", 1.5 * _float32(model)),
                        ("the logits", _logits(model, seq_len))])


def available() -> int | None:
    """Bytes this process may still take: the system's available memory (``MemAvailable``), lowered to what a
    cgroup (container) limit leaves; ``None`` where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)  # torchrun: the ranks on this machine share it
    return min(found) // max(ranks, 1) if found else None
