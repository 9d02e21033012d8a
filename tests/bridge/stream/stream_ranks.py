"""The streamed run on each rank of a real process group, for the distributed streaming tests (the jobs live
in an importable module: the ranks are spawned processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))

from dist_util import run_ranks  # noqa: E402

__all__ = ["run_ranks", "streamed", "calibration", "written"]


def calibration(n: int = 4, seq: int = 16, vocab: int = 64, seed: int = 1) -> list:
    """``n`` batches of token ids ``(1, seq)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, seq), generator=g) for _ in range(n)]


def written(directory: Path) -> dict:
    """``{file: bytes}`` of every file under ``directory`` (``{}`` when it does not exist)."""
    d = Path(directory)
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} if d.exists() else {}


def streamed(rank: int, world: int, source, out, preset: str, calib, kwargs=None):
    """``quantize_checkpoint`` on this rank (its ``out`` one per rank: what a rank other than 0 wrote is
    then seen apart); returns ``(mode, bytes_out, the quantized tensors' codes)``."""
    import qtransform as qt
    from bridge.stream import quantize_checkpoint

    torch.set_num_threads(1)
    done = quantize_checkpoint(source, out, qt.get_preset(preset).recipe, calibration=calib, **(kwargs or {}))
    return done.mode, done.bytes_out, sorted(done.info)
