"""Streamed quantization on several ranks (issue 30): what each rank holds at its peak, and the bytes.

    torchrun --nproc-per-node 2 bench/bench_stream_ranks.py --model DIR --out OUT --recipe gptq4-g128
    python bench/bench_stream_ranks.py --model DIR --out OUT --recipe gptq4-g128 --threads 2   # one process

Each rank runs :func:`bridge.stream.quantize_checkpoint` inside the torchrun group (gloo) on the same
``--calib`` random calibration sequences of ``--seq-len`` tokens (ids drawn with a fixed seed: the same on
every rank and in the one-process run), then prints one JSON line: its rank, its peak resident memory
(``getrusage``: this process alone), the wall time and the sha256 of every output file (rank 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", default="gptq4-g128")
    ap.add_argument("--calib", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-memory", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    import qtransform as qt
    from bridge.stream import quantize_checkpoint

    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, vocab, (1, a.seq_len), generator=g) for _ in range(a.calib)]
    recipe = qt.get_preset(a.recipe).recipe
    data = None if all(qt.get_algorithm(s.name).needs is None for s in recipe.steps) else calib
    t0 = time.perf_counter()
    done = quantize_checkpoint(a.model, a.out, recipe, calibration=data, overwrite=True, max_memory=a.max_memory)
    wall = time.perf_counter() - t0
    rank = dist.get_rank() if dist.is_initialized() else 0
    sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(Path(a.out).iterdir())
            if p.is_file()} if rank == 0 else None
    print(json.dumps({"rank": rank, "world": dist.get_world_size() if dist.is_initialized() else 1,
                      "mode": done.written.mode, "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                 * 1024 / 1e9, 3),
                      "wall_s": round(wall, 1), "sha256": sums}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
