"""Where dequantize + GEMM beats the packed CPU kernels: the token count behind ``PREFILL_ROWS``.

For int4 (group 128, or 64 where 128 does not divide in_features) and int8 per-channel weights
on SmolLM2- and 1B-Llama-sized layers, times side by side, interleaved, at each token count:
fp32 ``F.linear`` on the float weight (the target), the packed kernel alone
(``PREFILL_ROWS`` disabled) and the dequantize + ``F.linear`` path alone (threshold 1). Prints
milliseconds, each path's ratio to fp32, and per kernel the smallest token count from which
the dense path wins on every shape (the measured ``PREFILL_ROWS``).

    python bench/bench_prefill.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import qtransform as qt
from bridge.kernels import dense
from bridge.modules import QLinear

SHAPES = {"smollm2": [(576, 576), (1536, 576), (576, 1536)], "llama1b": [(2048, 2048), (5632, 2048), (2048, 5632)]}
ROWS = (1, 4, 8, 16, 32, 64, 128, 512, 2048)


def _median_ms(fns: dict, repeat: int) -> dict:
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(repeat):  # interleaved: load changes hit every path alike
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _module(w: torch.Tensor, fmt: str) -> QLinear:
    k = w.shape[1]
    g = qt.PerChannel(0) if fmt == "int8" else qt.PerGroup(128 if k % 128 == 0 else 64)
    lin = torch.nn.Linear(k, w.shape[0], bias=False)
    q = qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format=fmt, granularity=g)))
    return QLinear.from_float(lin, q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="smollm2,llama1b")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-rows", type=int, default=2048)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"# bench_prefill: threads {a.threads}, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    print("| kernel | shape (out x in) | tokens | fp32 ms | packed ms | dense ms | packed / fp32 | dense / fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    wins: dict[str, dict] = {}
    saved = dict(dense.PREFILL_ROWS)
    torch.manual_seed(0)
    for model in a.models.split(","):
        for n, k in SHAPES[model]:
            w = torch.randn(n, k) * 0.02
            for fmt in ("int4", "int8"):
                m = _module(w, fmt)
                name = m.kernel
                for rows in (r for r in ROWS if r <= a.max_rows):
                    x = torch.randn(rows, k)

                    def packed():
                        dense.PREFILL_ROWS[name] = None
                        return m(x)

                    def dense_path():
                        dense.PREFILL_ROWS[name] = 1
                        return m(x)

                    with torch.no_grad():
                        t = _median_ms({"fp32": lambda: F.linear(x, w), "packed": packed, "dense": dense_path},
                                       a.repeat)
                    dense.PREFILL_ROWS.update(saved)
                    wins.setdefault(name, {}).setdefault(rows, []).append(t["dense"] < t["packed"])
                    print(f"| {name} | {n} x {k} | {rows} | {t['fp32']:.3f} | {t['packed']:.3f} | {t['dense']:.3f} "
                          f"| {t['packed'] / t['fp32']:.2f} | {t['dense'] / t['fp32']:.2f} |")
    dense.release_buffers()
    print(f"\nload after: {os.getloadavg()[0]:.1f}")
    for name, by_rows in wins.items():
        rows = sorted(by_rows)
        from_rows = next((r for i, r in enumerate(rows) if all(all(by_rows[s]) for s in rows[i:])), None)
        print(f"{name}: dense + F.linear wins on every shape from {from_rows} tokens "
              f"(PREFILL_ROWS now {saved.get(name)})")


if __name__ == "__main__":
    main()
