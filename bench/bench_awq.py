"""AWQ on the default model (SmolLM2-135M-Instruct), side by side with llm-compressor's AWQ and GPTQ: perplexity
ratio quantized / float on 16x512 tokens of the built-in corpus's evaluation part, calibrated on 40x512 tokens
of its calibration part, and the seconds of the quantization call (calibration forward passes included), all
run in this script on the same tokens and threads, one after the other.

llm-compressor runs in its own virtualenv (``make bench-gptq-peer``): ``--peer-python /tmp/qtransform-llmc/bin/python``.

    .venv/bin/python bench/bench_awq.py [--peer-python PY] [--only uint4-asym-g64 ...] [--hqq] [--tokens 1024 4096]

``--hqq`` compares AWQ with HQQ as the inner quantizer against plain AWQ and HQQ alone (uint4/uint3, float
zero point, group 64); ``--tokens`` adds runs of AWQ with other token budgets; ``--ablation`` runs AWQ with one
part changed at a time (see ``ABLATION``) on the first scheme, ``--calib-offset N`` calibrates on the sequences
after the first ``N`` of the calibration part (a second slice), ``--no-gptq`` leaves out AWQ -> GPTQ.
"""

from __future__ import annotations

import json
import os

import torch

import qtransform as qt
from bridge.arch import model_groups

from bench_gptq import arguments, ours, peer, setup, spec_of
from common import markdown, write

#: AWQ with one part changed at a time: (name, awq options, description).
ABLATION = (
    ("defaults", {}, "ours, defaults"),
    ("no_scales", {"grid": 1}, "no scale search (only the clipping search)"),
    ("no_clip", {"clip": False}, "no clipping search (only the scales)"),
    ("per_linear", "per_linear", "scales scored on each linear's output, not the whole attention/MLP"),
    ("no_v_o", "no_v_o", "no v -> o group (the reference skips it when v and o differ in shape: GQA)"),
    ("magnitude_clip", {"clip_range": "magnitude"}, "the reference's clip: +-p max|w|, p from 1 to 0.55"),
    ("float_inputs", {"float_inputs": True}, "searched on the float model's block inputs (the reference's)"),
    ("reference", {"float_inputs": True, "clip_range": "magnitude"}, "float inputs and the reference's clip"),
)

SCHEMES = ("uint4-asym-g64", "uint4-asym-g128", "uint3-asym-g64")
#: The issue's anchors (SmolLM2-135M-Instruct, stdlib docstrings): Quark 0.13 AWQ, llm-compressor 0.14 GPTQ.
ANCHORS = {"uint4-asym-g64": ("860 s for 1 of 30 layers (stopped)", "x1.108, 162 s", "<= x1.10 in <= 60 s")}


def _x(v):
    return "-" if v is None else f"x{v}"


def main() -> None:
    ap = arguments(SCHEMES)
    ap.add_argument("--hqq", action="store_true", help="also compare AWQ with HQQ as the inner quantizer")
    ap.add_argument("--tokens", type=int, nargs="*", default=[], help="AWQ also with these token budgets")
    ap.add_argument("--hqq-only", action="store_true", help="only the HQQ comparison (results in awq_hqq.*)")
    ap.add_argument("--hqq-bits", type=int, nargs="*", default=[4, 3], help="bit widths of the HQQ comparison")
    ap.add_argument("--ablation", nargs="*", default=None, help="AWQ with one part changed at a time (ABLATION; "
                    "names to run only those)")
    ap.add_argument("--calib-offset", type=int, default=0, help="skip this many calibration sequences first")
    ap.add_argument("--no-gptq", action="store_true", help="leave out AWQ -> GPTQ")
    a = ap.parse_args()
    a.calib += a.calib_offset
    model, cal, ev, fp, files = setup(a)
    a.calib -= a.calib_offset
    if a.calib_offset:
        cal = cal[a.calib_offset:]
        torch.save(cal.clone(), files[0])
    if a.hqq_only:
        rows = hqq_comparison(model, cal, ev, fp, a.hqq_bits)
        table = markdown(HQQ_HEADER, [_hqq_cells(r) for r in rows])
        table += f"\n\nfloat perplexity {fp:.3f}; calibration {a.calib}x{a.seq_len} tokens; {a.threads} threads"
        write("awq_hqq", rows, table, {"fp_ppl": fp, "load_average": os.getloadavg()[0]})
        return
    rows = []
    for name in a.only or list(SCHEMES):
        spec = spec_of(name)
        row = {"scheme": name, "rtn": ours(model, spec, cal, ev, fp, [])["ratio"]}
        runs = [("awq", [qt.Step("awq")])] + ([] if a.no_gptq else [
            ("awq_gptq", [qt.Step("awq", clip=False), qt.Step("gptq")])])
        runs += [(f"awq_t{t}", [qt.Step("awq", tokens=t)]) for t in a.tokens]
        for key, steps in runs:
            r = ours(model, spec, cal, ev, fp, steps)
            row[key], row[f"{key}_s"] = r["ratio"], r["seconds"]
        row.setdefault("awq_gptq", None)
        row.setdefault("awq_gptq_s", None)
        row["calib_offset"] = a.calib_offset
        for method in ("awq", "gptq"):
            other = peer(a.peer_python, name, files, a.threads, method) if a.peer_python else None
            row[f"llmc_{method}"] = None if other is None else round(other["ppl"] / fp, 4)
            row[f"llmc_{method}_s"] = None if other is None else round(other["seconds"], 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = ["scheme", "RTN", "AWQ (ours)", "s", "AWQ->GPTQ (ours)", "s", "llm-compressor AWQ", "s",
              "llm-compressor GPTQ", "s", "goal", "peer anchors (Quark AWQ; llmc GPTQ)"]
    table = markdown(header, [[r["scheme"], _x(r["rtn"]), _x(r["awq"]), r["awq_s"], _x(r["awq_gptq"]), r["awq_gptq_s"] or "-",
                               _x(r["llmc_awq"]), r["llmc_awq_s"] or "-", _x(r["llmc_gptq"]), r["llmc_gptq_s"] or "-",
                               ANCHORS.get(r["scheme"], ("", "", "-"))[2],
                               "; ".join(ANCHORS.get(r["scheme"], ("-", "-"))[:2])] for r in rows])
    if a.tokens:
        table += "\n\n" + markdown(["scheme", *(f"AWQ, {t} tokens" for t in a.tokens)],
                                   [[r["scheme"], *(f"x{r[f'awq_t{t}']} ({r[f'awq_t{t}_s']} s)" for t in a.tokens)]
                                    for r in rows])
    ablation = ablation_rows(model, spec_of((a.only or list(SCHEMES))[0]), cal, ev, fp, a.ablation) if a.ablation is not None else []
    if ablation:
        table += "\n\n" + markdown(["AWQ variant", "perplexity ratio", "s"],
                                   [[r["description"], f"x{r['ratio']}", r["seconds"]] for r in ablation])
    hqq_rows = hqq_comparison(model, cal, ev, fp, a.hqq_bits) if a.hqq else []
    if hqq_rows:
        table += "\n\n" + markdown(HQQ_HEADER, [_hqq_cells(r) for r in hqq_rows])
    table += (f"\n\nfloat perplexity {fp:.3f} on {ev.numel()} tokens; calibration {a.calib}x{a.seq_len} tokens"
              f"{f' (after the first {a.calib_offset} sequences)' if a.calib_offset else ''}; "
              f"{a.threads} threads; load average {os.getloadavg()[0]:.1f}")
    write("awq", rows + hqq_rows, table, {"fp_ppl": fp, "load_average": os.getloadavg()[0], "ablation": ablation})


def ablation_rows(model, spec, cal, ev, fp, names=()) -> list[dict]:
    """AWQ with one part changed at a time (:data:`ABLATION`, or those of ``names``) on ``spec``."""
    groups = model_groups(model)
    out = []
    for name, options, description in ABLATION:
        if names and name not in names:
            continue
        if options == "per_linear":
            options = {"groups": [{k: v for k, v in g.items() if k not in ("inspect", "local")} for g in groups]}
        elif options == "no_v_o":
            options = {"groups": [g for g in groups if not g["prev"].endswith("v_proj")]}
        r = ours(model, spec, cal, ev, fp, [qt.Step("awq", **options)])
        out.append({"variant": name, "description": description, "ratio": r["ratio"], "seconds": r["seconds"]})
        print(json.dumps(out[-1]), flush=True)
    return out


HQQ_HEADER = ["scheme (float zero point, g64)", "HQQ alone", "AWQ (min/max inner)", "AWQ with HQQ inner"]


def _hqq_cells(r: dict) -> list:
    return [r["scheme"], f"x{r['hqq']}", f"x{r['awq']}", f"x{r['awq_hqq']}"]


def hqq_comparison(model, cal, ev, fp, bit_widths=(4, 3)) -> list[dict]:
    out = []
    for bits in bit_widths:
        spec = qt.QuantSpec(format=f"uint{bits}", granularity=qt.PerGroup(64), symmetric=False, pad=True,
                            zero_point_domain="float", scale_dtype="float16")
        row = {"scheme": f"uint{bits}-asym-g64 (float zp)"}
        for key, steps in (("hqq", [qt.Step("hqq", error_norm=4.0)]), ("awq", [qt.Step("awq")]),
                           ("awq_hqq", [qt.Step("awq", quantizer="hqq")])):
            row[key] = ours(model, spec, cal, ev, fp, steps)["ratio"]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


if __name__ == "__main__":
    main()
