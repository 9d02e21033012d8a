"""Low-rank error compensation (the ``lowrank`` step, EoRA) on the default model (SmolLM2-135M-Instruct):
perplexity ratio quantized / float on 16x512 tokens of the built-in corpus's evaluation part, calibrated on
40x512 tokens of its calibration part, for RTN and GPTQ at uint4 g128, uint3 g64 and uint2 g64 (asymmetric,
integer zero point, the linears of the blocks; lm_head left in float as bench_gptq.py does), each without
and with corrections of rank 8, 32 and 128, and what the corrections cost: bytes (stored in 16 bits, the
checkpoint dtype of a bf16 model; twice that in float32) and extra bits per quantized weight.

One quantization per (scheme, base) runs ``[base, lowrank(rank=128)]``; the rank-8 and rank-32 corrections
are the first 8 and 32 components of it, which *is* the rank-r optimum (the truncated SVD is nested:
tests/algorithms/test_lowrank.py checks it), so the three ranks cost one calibration pass.

    .venv/bin/python bench/bench_lowrank.py [--only uint2-asym-g64 ...] [--calib 40] [--eval 16] [--threads 2]

bench/results/lowrank.md was run with ``--calib 8 --eval 4 --seq-len 256`` (2 CPU cores shared by five
sessions' benchmarks: the full sizes did not fit the time).
"""

from __future__ import annotations

import json
import os
import time

import torch

import bridge
import qtransform as qt
from bridge.app import evaluate
from bridge.modules.lowrank import lowrank_of
from bench_gptq import arguments, setup
from common import markdown, write

#: name -> (format, group)
SCHEMES = {"uint2-asym-g64": ("uint2", 64), "uint4-asym-g128": ("uint4", 128), "uint3-asym-g64": ("uint3", 64)}
RANKS = (8, 32, 128)


def truncate(model, corrections: dict, rank: int) -> None:
    """Put the first ``rank`` components of each correction on ``model``'s QLinears."""
    for path, c in corrections.items():
        model.get_submodule(path.rpartition(".")[0]).set_lowrank(qt.LowRank(a=c.a[:rank], b=c.b[:, :rank]))


def run(model, spec, base: str, cal, ev, fp) -> dict:
    steps = ([qt.Step("gptq")] if base == "gptq" else []) + [qt.Step("lowrank", rank=max(RANKS))]
    recipe = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"], steps=steps)
    t = time.perf_counter()
    with torch.no_grad():
        qm = bridge.quantize(model, recipe, calibration=list(cal.split(4)), kernel="dequant")
    seconds = time.perf_counter() - t
    full = lowrank_of(qm)
    numel = sum(m.in_features * m.out_features for m in (qm.get_submodule(p.rpartition(".")[0]) for p in full))
    row = {"base": base, "seconds": round(seconds, 1), "linears": len(full), "weights": numel}
    for rank in (0, *RANKS):
        if rank:
            truncate(qm, full, rank)
        else:
            for p in full:
                qm.get_submodule(p.rpartition(".")[0]).set_lowrank(None)
        with torch.no_grad():
            ppl = evaluate.perplexity(qm, ev).perplexity
        elements = sum(min(rank, c.rank) * (c.a.shape[1] + c.b.shape[0]) for c in full.values())
        row[f"r{rank}"] = {"ppl": round(ppl, 3), "ratio": round(ppl / fp, 4), "mb16": round(2 * elements / 1e6, 2),
                           "bits": round(16 * elements / numel, 3)}
        print(json.dumps({"base": base, "rank": rank, **row[f"r{rank}"]}), flush=True)
    return row


def main() -> None:
    ap = arguments(SCHEMES)
    a = ap.parse_args()
    model, cal, ev, fp, _ = setup(a)
    rows = []
    for name in a.only or list(SCHEMES):
        fmt, group = SCHEMES[name]
        spec = qt.QuantSpec(format=fmt, granularity=qt.PerGroup(group), symmetric=False, pad=True)
        for base in ("rtn", "gptq"):
            row = {"scheme": name, **run(model, spec, base, cal, ev, fp)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    head = ["scheme", "base", "no correction"] + [f"rank {r}" for r in RANKS] + [
        f"rank {r}: MB (16-bit), +bits/weight" for r in RANKS]
    table = markdown(head, [[r["scheme"], r["base"].upper(), f"x{r['r0']['ratio']}",
                             *(f"x{r[f'r{k}']['ratio']}" for k in RANKS),
                             *(f"{r[f'r{k}']['mb16']} MB, +{r[f'r{k}']['bits']}" for k in RANKS)] for r in rows])
    table += (f"\n\nfloat perplexity {fp:.3f} on {ev.numel()} tokens; calibration {a.calib}x{a.seq_len} tokens; "
              f"{rows[0]['linears'] if rows else 0} linears, {rows[0]['weights'] / 1e6 if rows else 0:.1f}M weights; "
              f"{a.threads} threads; load average {os.getloadavg()[0]:.1f}")
    write("lowrank", rows, table, {"fp_ppl": fp, "load_average": os.getloadavg()[0]})


if __name__ == "__main__":
    main()
