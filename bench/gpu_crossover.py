"""Where int4 weight-only stops paying on a GPU, and what a bf16 decode step spends its time on (issue 31).

1. One Llama-3-8B decoder's linear shapes (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down
   4096x14336), one layer's worth per call, at 1..2048 token rows: bf16 ``F.linear`` against our
   ``int4`` g128 ``QLinear`` through ``int4pack_cuda`` (tinygemm) and through its dequantize +
   ``F.linear`` path (``dense.PREFILL_ROWS``): microseconds per layer (CUDA events, median of 7 after warm-ups).
   ``dense.PREFILL_ROWS["int4pack_cuda"]`` is set from this table.
2. The per-step time of 16 decode steps of the SmolLM2-shaped bf16 model (``bench_gpu.py``'s decode
   loop) and the operators that take its host time (torch.profiler).

    python3 bench/gpu_crossover.py            # on the GPU machine (about 30 s)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qtransform as qt  # noqa: E402
from bridge import QLinear  # noqa: E402
from bridge.kernels import dense  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
ROWS = [1, 8, 16, 32, 64, 128, 256, 512, 2048]
if len(sys.argv) > 2:  # a smoke test: few rows
    ROWS = ROWS[:2]


def median_us(fn, dev, reps=7, inner=5):
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / inner)
        else:
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t) * 1e6 / inner)
    return sorted(times)[len(times) // 2]


def crossover(dev):
    gen = torch.Generator().manual_seed(0)
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128))
    ws = [torch.randn(n, k, generator=gen) * 0.02 for n, k in SHAPES]
    bf = [w.to(dev, torch.bfloat16) for w in ws]
    q = []
    for w in ws:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w
        q.append(QLinear.from_float(lin, qt.quantize(w, qt.choose_qparams(w, spec))).to(dev))
    print("| rows | bf16 F.linear us | int4 tinygemm us | int4 dequant+F.linear us | kernel |")
    print("|---|---|---|---|---|")
    for m in ROWS:
        xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _, k in SHAPES]
        with torch.no_grad():
            t_bf = median_us(lambda: [F.linear(x, w) for x, w in zip(xs, bf)], dev)
            dense.PREFILL_ROWS["int4pack_cuda"] = None
            t_k = median_us(lambda: [lin(x) for x, lin in zip(xs, q)], dev)
            dense.PREFILL_ROWS["int4pack_cuda"] = 1
            t_d = median_us(lambda: [lin(x) for x, lin in zip(xs, q)], dev)
            dense.PREFILL_ROWS["int4pack_cuda"] = None
        print(f"| {m} | {t_bf:.1f} | {t_k:.1f} | {t_d:.1f} | {q[0].kernel} |", flush=True)


def decode_profile(dev):
    import gpu_common as G

    model = G.build_model("smollm2-135m", dev, dtype=torch.bfloat16)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(4)).to(dev)
    with torch.no_grad():
        out = model(prompt, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(16):
            G.sync(dev)
            t = time.perf_counter()
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            G.sync(dev)
            steps.append(round((time.perf_counter() - t) * 1e3, 2))
        print("bf16 smollm2 decode step ms:", steps, flush=True)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(3):
                out = model(tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            G.sync(dev)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=48))


if __name__ == "__main__":
    dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    print(torch.__version__, torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu")
    crossover(dev)
    decode_profile(dev)
