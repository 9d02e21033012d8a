"""QLinear forward against fp32 and bf16 F.linear, side by side in one process.

Shapes are PyTorch weight shapes (out_features, in_features): SmolLM2-135M's down_proj
(576x1536) and Llama-7B's square and up_proj projections (4096x4096, 11008x4096), at batch 1
and 32. Quantized: int4 per-group 128 (symmetric) and int8 per-channel, with the kernel the
module chooses (``module.kernel``). Each time is the best of several repeats (the machine is
shared; the minimum is the least disturbed). The memory-bandwidth limit of a layer is its
weight bytes divided by the bandwidth the fp32 run achieves at batch 1.

    python bench/bench_linear.py [--threads N] [--repeats R]

Writes bench/results/linear.json and bench/results/linear.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import qtransform as qt
from bridge import QLinear

SHAPES = {"SmolLM2 down_proj": (576, 1536), "Llama-7B q_proj": (4096, 4096), "Llama-7B up_proj": (11008, 4096)}
SPECS = {"int4 g128": qt.QuantSpec(format="int4", granularity=qt.PerGroup(128)),
         "int8 per-channel": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))}
OUT = Path(__file__).parent / "results"


def best_ms(fn, *, repeats: int, budget_s: float = 0.25) -> float:
    fn()
    t = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t, 1e-5)
    n = max(1, min(200, int(budget_s / one)))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e3


def kernel_bytes(m: QLinear) -> int:
    """Bytes the chosen kernel reads per call (its packed weight and scales)."""
    m(torch.zeros(1, m.in_features))
    state = m._cache[2] or {}
    tensors = [t for t in state.values() if isinstance(t, torch.Tensor)]
    if not tensors:
        tensors = [m._buffers[n] for n in m._qnames]
    return sum(t.numel() * t.element_size() for t in tensors)


def run(threads: int | None, repeats: int) -> dict:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for label, (n, k) in SHAPES.items():
            w = torch.randn(n, k) * 0.02
            wb = w.bfloat16()
            mods = {name: QLinear(qt.quantize(w, qt.choose_qparams(w, spec))) for name, spec in SPECS.items()}
            for batch in (1, 32):
                x = torch.randn(batch, k)
                xb = x.bfloat16()
                t32 = best_ms(lambda: F.linear(x, w), repeats=repeats)
                bw = n * k * 4 / (t32 * 1e-3)  # bytes/s achieved by fp32 (meaningful at batch 1)
                if batch == 1:
                    bandwidth = bw
                entries = {"fp32 F.linear": (t32, n * k * 4, "-"),
                           "bf16 F.linear": (best_ms(lambda: F.linear(xb, wb), repeats=repeats), n * k * 2, "-")}
                for name, m in mods.items():
                    entries[f"QLinear {name}"] = (best_ms(lambda: m(x), repeats=repeats), kernel_bytes(m), m.kernel)
                for name, (ms, nbytes, kern) in entries.items():
                    limit_ms = nbytes / bandwidth * 1e3
                    rows.append({"shape": label, "weight": [n, k], "batch": batch, "path": name, "kernel": kern,
                                 "ms": round(ms, 4), "speedup_vs_fp32": round(t32 / ms, 2),
                                 "weight_bytes": nbytes, "bandwidth_fraction": round(limit_ms / ms, 3)})
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "repeats": repeats,
            "load_average": os.getloadavg(), "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"torch {res['torch']}, {res['threads']} thread(s), CPU capability {res['cpu_capability']}, "
             f"load average at the end {tuple(round(v, 1) for v in res['load_average'])}.",
             "Speedup is against fp32 `F.linear` on the same shape and batch; the bandwidth fraction is "
             "(weight bytes read / bandwidth of the fp32 batch-1 run) / time.", "",
             "| weight (out x in) | batch | path | kernel | ms | x fp32 | of bandwidth limit |",
             "|---|---:|---|---|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['shape']} {r['weight'][0]}x{r['weight'][1]} | {r['batch']} | {r['path']} | {r['kernel']} "
                     f"| {r['ms']:.3f} | {r['speedup_vs_fp32']:.2f} | {100 * r['bandwidth_fraction']:.0f}% |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    res = run(args.threads, args.repeats)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "linear.json").write_text(json.dumps(res, indent=2) + "\n")
    (OUT / "linear.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
