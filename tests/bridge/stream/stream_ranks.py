"""The streamed run on each rank of a real process group, for the distributed streaming tests (the jobs live
in an importable module: the ranks are separate processes, the job pickled by name)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))

from dist_util import run_ranks  # noqa: E402

__all__ = ["run_ranks", "calibration", "written", "same_outputs", "crash_and_resume", "everything"]


def calibration(n: int = 4, seq: int = 16, vocab: int = 16, seed: int = 1) -> list:
    """``n`` batches of token ids ``(1, seq)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, seq), generator=g) for _ in range(n)]


def written(directory: Path) -> dict:
    """``{file: bytes}`` of every file under ``directory`` (``{}`` when it does not exist)."""
    d = Path(directory)
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} if d.exists() else {}


def _quantize(source, out, preset, calib, **kwargs):
    import qtransform as qt
    from bridge.stream import quantize_checkpoint

    return quantize_checkpoint(source, out, qt.get_preset(preset).recipe, calibration=calib, **kwargs)


def same_outputs(rank: int, world: int, source, root, cases):
    """For each ``(preset, calibrated, shared, kwargs)`` of ``cases``: rank 0 first runs it alone (one process,
    ``root/<preset>-one``), then every rank runs it together into ``root/<preset>`` (``shared``: every rank is
    given that path; else the other ranks get ``root/rank<r>/<preset>``, as on a file system of their own).
    Returns ``{preset: (mode, bytes_out, the QParams of the activation sites)}``."""
    import qtransform as qt

    torch.set_num_threads(1)
    root, out = Path(root), {}
    for preset, calibrated, shared, kwargs in cases:
        calib = calibration() if calibrated else None
        if rank == 0:
            _quantize(source, root / f"{preset}-one", preset, calib, parallel=qt.SERIAL, **kwargs)
        target = root / preset if rank == 0 or shared else root / f"rank{rank}" / preset
        done = _quantize(source, target, preset, calib, **kwargs)
        acts = {f"{s.module}|{s.role}": [t.tolist() for t in q.tensors().values()]
                for s, q in done.activations.items() if isinstance(q, qt.QParams)}
        out[preset] = (done.written.mode, done.written.bytes_out, acts)
    return out


def crash_and_resume(rank: int, world: int, source, out, preset: str, crash_at: int, **kwargs):
    """A run of every rank that fails at block ``crash_at`` (on every rank, as a crash of the job would stop
    them), then rank 0 alone tries ``resume=True`` (refused: other ranks), then every rank resumes. Returns
    ``(the manifest's units after the crash, rank 0's refusal message, units resumed)``."""
    import json

    import qtransform as qt
    from bridge.stream import blocks

    torch.set_num_threads(1)
    real = blocks.BlockRun._block

    def failing(self, name):
        if name.endswith(f".{crash_at}"):
            raise RuntimeError("crash")
        return real(self, name)

    blocks.BlockRun._block = failing
    try:
        _quantize(source, out, preset, calibration(), **kwargs)
    except RuntimeError as e:
        if str(e) != "crash":
            raise
    finally:
        blocks.BlockRun._block = real
    partial = Path(out).parent / f".{Path(out).name}.partial"
    done = json.loads((partial / "manifest.json").read_text())["done"] if rank == 0 else None
    refused = None
    if rank == 0:
        try:
            _quantize(source, out, preset, calibration(), resume=True, parallel=qt.SERIAL, **kwargs)
        except ValueError as e:
            refused = str(e)
    resumed = _quantize(source, out, preset, calibration(), resume=True, **kwargs).written.resumed
    return done, refused, resumed


def everything(rank: int, world: int, source, root, cases, resume_preset: str, crash_at: int, kwargs):
    """:func:`same_outputs` of ``cases`` in ``root``, then :func:`crash_and_resume` into ``root/resumed`` (one
    process group for both: spawning one costs seconds)."""
    return (same_outputs(rank, world, source, root, cases),
            crash_and_resume(rank, world, source, Path(root) / "resumed", resume_preset, crash_at, **kwargs))
