"""Per-format quantize + dequantize throughput against AMD Quark and torchao, side by side.

For every floating-point and block-scaled format, on one 4096x4096 float32 tensor in one
process: qtransform's round trip through real storage (``choose_qparams`` + ``quantize`` +
``dequantize``: packed codes, E8M0/fp8 scales) and its fake-quantize path (``choose_qparams``
+ ``fake_quantize``), against Quark's CPU emulation of the same format (its fake-quantize
kernels, scale computation included) and torchao's MX / NVFP4 implementation (``to_mx`` +
``to_dtype``, ``NVFP4Tensor.to_nvfp4`` + ``dequantize``). Each timing is the best of
``--repeats`` runs, the implementations taking turns so that a busy machine slows all alike.
Agreement is ``torch.equal`` of the dequantized tensors (the same scale rule on both sides).

Run: ``python bench/bench_formats.py`` (writes bench/results/formats.json and formats.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
import warnings
from pathlib import Path

import torch

import qtransform as qt

RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------- peers
def _quark():
    logging.disable(logging.WARNING)
    from quark.torch.kernel.hw_emulation import hw_emulation_interface as h
    logging.disable(logging.NOTSET)
    return h


def _torchao():
    warnings.filterwarnings("ignore")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    return dict(to_mx=to_mx, to_dtype=to_dtype, modes={"floor": ScaleCalculationMode.FLOOR,
                                                       "even": ScaleCalculationMode.EVEN},
                elems={"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2,
                       "mxfp6_e3m2": DTYPE_FP6_E3M2, "mxfp6_e2m3": DTYPE_FP6_E2M3, "mxfp4": torch.float4_e2m1fn_x2},
                nvfp4=NVFP4Tensor, nvfp4_scale=per_tensor_amax_to_scale)


QUARK_MX = {"mxfp8_e4m3": "fp8_e4m3", "mxfp8_e5m2": "fp8_e5m2", "mxfp6_e3m2": "fp6_e3m2",
            "mxfp6_e2m3": "fp6_e2m3", "mxfp4": "fp4", "mxint8": "int8"}
QUARK_FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def _quark_fn(h, name, rule):
    """Quark's fake-quantize emulation of ``name`` (scale computation included), or None."""
    if name in QUARK_MX:
        return lambda x: h.fake_quantize_mx(x, axis=-1, block_size=32, scale_calculation_mode=rule,
                                            mx_element_dtype=QUARK_MX[name])
    if name in ("mx9", "mx6", "mx4"):
        bits = {"mx9": 8, "mx6": 5, "mx4": 3}[name]
        return lambda x: h.fake_quantize_mx6_mx9(x, axis=-1, block_size=16, quant_bit=bits, sub_block_size=2)
    if name == "bfp16":
        return lambda x: h.fake_quantize_bfp16(x, axis=-1, block_size=8)
    if name in QUARK_FP8:
        dtype, top = QUARK_FP8[name]
        return lambda x: h.fake_quantize_fp8_per_tensor_with_scale(x, x.abs().amax() / top, dtype=dtype,
                                                                   max_value=top)
    if name in ("fp4_e2m1", "fp6_e3m2", "fp6_e2m3"):  # Quark has no per-tensor fp4: groups of 32
        qname = {"fp4_e2m1": "fp4", "fp6_e3m2": "fp6_e3m2", "fp6_e2m3": "fp6_e2m3"}[name]
        top = qt.FORMATS[name].codec.max_value
        return lambda x: h.fake_quantize_fp4_fp6_per_group_with_scale(
            x, x.reshape(x.shape[0], -1, 32).abs().amax(-1) / top, axis=-1, group_size=32, quant_dtype=qname)
    if name in ("bf16", "fp16"):
        return lambda x: h.fake_quantize_with_dtype_convert(x, {"bf16": "bfloat16", "fp16": "float16"}[name])
    return None


def _torchao_fn(ao, name, rule):
    if name in ao["elems"] and rule in ao["modes"]:
        elem, mode = ao["elems"][name], ao["modes"][rule]

        def mx(x):
            scale, data = ao["to_mx"](x, elem, 32, mode)
            return ao["to_dtype"](data, scale, elem, 32, torch.float32)
        return mx
    if name == "nvfp4":
        return lambda x: ao["nvfp4"].to_nvfp4(x, per_tensor_scale=ao["nvfp4_scale"](x.abs().amax())).dequantize(
            torch.float32)
    return None


# ---------------------------------------------------------------- cases
def _spec(name, rule):
    fmt = qt.FORMATS[name]
    if name in ("fp4_e2m1", "fp6_e3m2", "fp6_e2m3"):
        return qt.QuantSpec(format=name, granularity=qt.PerGroup(32))
    if fmt.family == "mx":
        return qt.QuantSpec(format=name, scale_rule=rule)
    return qt.QuantSpec(format=name)


CASES = [  # (format, scale rule for MX)
    ("fp8_e4m3", None), ("fp8_e5m2", None), ("fp8_e4m3fnuz", None), ("fp8_e5m2fnuz", None),
    ("fp6_e3m2", None), ("fp6_e2m3", None), ("fp4_e2m1", None), ("bf16", None), ("fp16", None),
    ("mxfp8_e4m3", "floor"), ("mxfp8_e5m2", "floor"), ("mxfp6_e3m2", "floor"), ("mxfp6_e2m3", "floor"),
    ("mxfp4", "floor"), ("mxint8", "floor"), ("mxfp8_e4m3", "even"), ("mxfp4", "even"),
    ("mx9", None), ("mx6", None), ("mx4", None), ("bfp16", None), ("nvfp4", None),
]


def _best(fns: dict, repeats: int) -> dict:
    """Best wall time (ms) of each function, running them in turns."""
    best = {k: float("inf") for k in fns}
    for k, f in fns.items():
        f()  # warm-up
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], (time.perf_counter() - t0) * 1e3)
    return best


def _agree(ours: torch.Tensor, theirs: torch.Tensor) -> str:
    if torch.equal(ours, theirs):
        return "exact"
    return f"{int((ours != theirs).sum())} of {ours.numel()} differ"


def run(size: int, repeats: int, only=None) -> list[dict]:
    h, ao = _quark(), _torchao()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen)
    rows = []
    for name, rule in CASES:
        if only and name not in only:
            continue
        spec = _spec(name, rule)

        def ours_qdq(spec=spec):
            return qt.dequantize(qt.quantize(x, qt.choose_qparams(x, spec)))

        def ours_fake(spec=spec):
            return qt.fake_quantize(x, qt.choose_qparams(x, spec))

        fns = {"ours": ours_qdq, "ours_fake": ours_fake}
        peers = {"quark": _quark_fn(h, name, rule or "floor"), "torchao": _torchao_fn(ao, name, rule or "floor")}
        fns.update({k: (lambda f=f: f(x)) for k, f in peers.items() if f is not None})
        times = _best(fns, repeats)
        y = ours_qdq()
        row = {"format": name, "scale_rule": rule, "spec": str(spec), "bits_per_element": qt.bits_per_element(spec),
               "ours_ms": times["ours"], "ours_fake_ms": times["ours_fake"]}
        assert torch.equal(ours_fake(), y), name
        for peer in ("quark", "torchao"):
            if peer in fns:
                row[f"{peer}_ms"] = times[peer]
                row[f"{peer}_speedup"] = times[peer] / times["ours"]
                row[f"{peer}_fake_speedup"] = times[peer] / times["ours_fake"]
                row[f"{peer}_agreement"] = _agree(y, fns[peer]())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _markdown(rows: list[dict], meta: dict) -> str:
    def ms(v):
        return "—" if v is None else f"{v:.0f}"

    def ratio(r, peer):
        if f"{peer}_ms" not in r:
            return "—"
        return f"{r[f'{peer}_speedup']:.1f}x / {r[f'{peer}_fake_speedup']:.1f}x"

    lines = [
        f"Quantize + dequantize of a {meta['size']}x{meta['size']} float32 tensor, best of {meta['repeats']} "
        f"(ms; {meta['threads']} thread(s), torch {meta['torch']}, {meta['machine']}, load average at the end "
        f"{meta['load']}). "
        "ours = choose_qparams + quantize + dequantize through packed storage; fake = choose_qparams + "
        "fake_quantize. Speedup = peer time / ours (storage round trip / fake-quantize).",
        "",
        "| format | rule | bits/elem | ours | ours fake | Quark | vs Quark | Quark agrees | torchao | vs torchao "
        "| torchao agrees |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['scale_rule'] or ''} | {r['bits_per_element']:g} | {ms(r['ours_ms'])} | "
            f"{ms(r['ours_fake_ms'])} | {ms(r.get('quark_ms'))} | {ratio(r, 'quark')} | "
            f"{r.get('quark_agreement', '—')} | {ms(r.get('torchao_ms'))} | {ratio(r, 'torchao')} | "
            f"{r.get('torchao_agreement', '—')} |")
    lines += [
        "",
        "Quark has no per-tensor fp4/fp6 and no fnuz fake-quantize path: the fp4/fp6 rows use groups of 32 with "
        "float32 scales amax / max on both sides, the fnuz rows have no peer. torchao rows are its MX and NVFP4 "
        "implementations (FLOOR / EVEN scale modes). Agreement is bit for bit on the dequantized tensor; "
        "torchao's NVFP4 multiplies by the reciprocal of the combined scale where qtransform divides by it, "
        "so an element on a rounding boundary can land on the other side. bf16/fp16 are baselines: Quark's "
        "path is two casts, while qtransform carries the unit scale through the common pipeline (observe, "
        "divide, multiply)."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", nargs="*", help="formats to run (default: all)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every implementation (default 1: Quark's CPU kernel is serial, and "
                         "one thread gives reproducible timings on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    meta = {"size": args.size, "repeats": args.repeats, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    rows = run(args.size, args.repeats, args.only)
    meta["load"] = tuple(round(v, 1) for v in os.getloadavg())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "formats.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (RESULTS / "formats.md").write_text(_markdown(rows, meta))
    print(_markdown(rows, meta))


if __name__ == "__main__":
    main()
