"""The calibration activations a streamed run carries from block to block: in memory up to a budget, on
disk beyond it.

A run keeps one *stream* per pass the in-memory pipeline would make over the model (one per block-by-block
step, one for the static activation quantizers): the inputs of the next block for every calibration batch,
``(args, kwargs)`` as the block is called. The hidden states (the first tensor) of the streams not being
worked on live in memory while the total stays under ``budget`` bytes (``None``: no limit) and are written
to ``directory`` beyond it (safetensors files, read back when their block comes). The other arguments
(position embeddings, masks) are the same for every block and are kept once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["ActivationCache"]


class ActivationCache:
    """Hidden states by key (see the module docstring); ``spilled`` counts those written to disk."""

    def __init__(self, directory, budget: int | None = None):
        self.directory, self.budget = Path(directory), budget
        self._memory: dict[str, torch.Tensor] = {}
        self._disk: dict[str, int] = {}
        self.held = 0
        self.peak = 0
        self.spilled = 0

    def _file(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def put(self, key: str, t: torch.Tensor) -> None:
        self.pop(key)
        t = t.detach().to("cpu")
        n = t.numel() * t.element_size()
        if self.budget is not None and self.held + n > self.budget:
            self.directory.mkdir(parents=True, exist_ok=True)
            save_file({"h": t.contiguous()}, str(self._file(key)))
            self._disk[key] = n
            self.spilled += 1
            return
        self._memory[key] = t
        self.held += n
        self.peak = max(self.peak, self.held)

    def get(self, key: str) -> torch.Tensor:
        if key in self._memory:
            return self._memory[key]
        if key in self._disk:
            return load_file(str(self._file(key)))["h"]
        raise KeyError(key)

    def pop(self, key: str) -> None:
        t = self._memory.pop(key, None)
        if t is not None:
            self.held -= t.numel() * t.element_size()
        if key in self._disk:
            del self._disk[key]
            os.unlink(self._file(key))

    @property
    def total(self) -> int:
        """Bytes of every hidden state kept, in memory and on disk."""
        return self.held + sum(self._disk.values())

    def __contains__(self, key: str) -> bool:
        return key in self._memory or key in self._disk
