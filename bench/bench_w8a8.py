"""W8A8 int8 QLinear on CPU: the ``torch._int_mm`` kernel against the dequantize reference and int8pack.

One QLinear per shape (int8 per-channel symmetric weights in [-127, 127], dynamic per-token int8
asymmetric input quantizer with integer zero points: the ``w8a8-int8-dynamic`` preset's specs), run with each forward path forced:

* ``int8_int_mm_cpu``: quantize the activations, ``torch._int_mm`` (int8 x int8 -> int32), rescale;
* ``dequant``: the reference (fake-quantize the activations, dequantize the weight, fp32 ``F.linear``);
* ``int8pack_cpu``: fake-quantize the activations, then the weight-only ``_weight_int8pack_mm`` (bf16);
* ``int8_dynamic_cpu`` (the automatic choice for this scheme): the fused per-token quantizer and the C++
  int8 GEMV below ``int8dyn.MAX_ROWS`` tokens, fake-quantize (fused) + ``F.linear`` from there on;

plus fp32 ``F.linear`` on the float weight, ``torch._int_mm`` alone on ready int8 codes (the
integer GEMM without quantizing or rescaling), and the input quantizer alone (fake-quantize the
activations): the general ``choose_qparams`` + ``fake_quantize`` against the fused
``int8dyn.token_fake_quantize`` (equal results). Shapes are SmolLM2-135M's up/gate projection
(576 -> 1536), its down projection (1536 -> 576) and a 4096 x 4096 layer, at 1, 16, 128 and 512
tokens. Times are medians of interleaved repeats (``common.timeit``); the load average before and
after is recorded (the machine is shared).

    python bench/bench_w8a8.py [--repeat R] [--threads T]

Writes bench/results/w8a8.json and bench/results/w8a8.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import qtransform as qt
from bridge import QLinear
from bridge.kernels import int8dyn
from common import markdown, timeit, write

SHAPES = {"SmolLM2 up 576->1536": (1536, 576), "SmolLM2 down 1536->576": (576, 1536), "4096x4096": (4096, 4096)}
TOKENS = (1, 16, 128, 512)
W_SPEC = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), symmetric_range="restricted")  # as the preset
X_SPEC = qt.QuantSpec(format="int8", dynamic=True, granularity=qt.PerChannel(0), symmetric=False)
PATHS = ("int8_int_mm_cpu", "dequant", "int8pack_cpu", "int8_dynamic_cpu")


def modules(w: torch.Tensor) -> dict[str, QLinear]:
    q = qt.quantize(w, qt.choose_qparams(w, W_SPEC))
    return {k: QLinear(q, input_quant=X_SPEC, kernel=k) for k in PATHS}


def run(repeat: int) -> tuple[list[dict], dict]:
    load = {"load_before": os.getloadavg()}
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for label, (n, k) in SHAPES.items():
            w = torch.randn(n, k) * 0.02
            mods = modules(w)
            codes_w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
            for m in TOKENS:
                x = torch.randn(m, k)
                codes_x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
                fns = {f"QLinear {p}": (lambda mod=mod: mod(x)) for p, mod in mods.items()}
                fns["fp32 F.linear"] = lambda: F.linear(x, w)
                fns["torch._int_mm alone"] = lambda: torch._int_mm(codes_x, codes_w.t())
                fns["input quantizer alone, general"] = lambda: qt.fake_quantize(x, qt.choose_qparams(x, X_SPEC))
                fns["input quantizer alone, fused"] = lambda: int8dyn.token_fake_quantize(x, X_SPEC)
                t = timeit(fns, repeat=repeat)
                outs = {p: mod(x) for p, mod in mods.items()}
                scale = outs["dequant"].abs().max()
                for name, s in t.items():
                    p = name.split()[-1]
                    err = ((outs[p] - outs["dequant"]).abs().max() / scale).item() if p in outs else None
                    rows.append({"shape": label, "weight": [n, k], "tokens": m, "path": name, "ms": round(s * 1e3, 4),
                                 "vs_dequant": round(t["QLinear dequant"] / s, 3), "max_rel_err_vs_dequant": err})
    load["load_after"] = os.getloadavg()
    return rows, load


def table(rows: list[dict], load: dict) -> str:
    head = (f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, int8 dot-product instructions (VNNI/AMX): "
            f"{_int8_dot()}; load average before {tuple(round(v, 2) for v in load['load_before'])}, "
            f"after {tuple(round(v, 2) for v in load['load_after'])}.\n"
            "Medians in ms; `x dequant` is the dequant reference's time over the path's (above 1: faster).\n\n")
    body = markdown(["weight (out x in)", "tokens", "path", "ms", "x dequant", "max rel err vs dequant"],
                    [[f"{r['shape']} {r['weight'][0]}x{r['weight'][1]}", r["tokens"], r["path"], f"{r['ms']:.3f}",
                      f"{r['vs_dequant']:.2f}", "-" if r["max_rel_err_vs_dequant"] is None
                      else f"{r['max_rel_err_vs_dequant']:.1e}"] for r in rows])
    return head + body


def _int8_dot() -> bool:
    from bridge.kernels.int8mm import int8_dot_cpu
    return int8_dot_cpu()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="interleaved repeats per cell (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, load = run(args.repeat)
    write("w8a8", rows, table(rows, load), extra={**load, "int8_dot_cpu": _int8_dot(), "repeat": args.repeat,
                                                   "cpu_capability": torch.backends.cpu.get_cpu_capability()})


if __name__ == "__main__":
    main()
