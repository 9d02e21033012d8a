"""Scale-out on this 2-core machine: GPTQ (``gptq4-g64``) and AWQ (``awq4-g64``) on the default model
(SmolLM2-135M-Instruct), calibrated on 16x512 tokens of the built-in corpus's calibration part, in one process
with 2 threads and under ``torchrun --nproc-per-node 2`` with 1 thread per rank (OMP_NUM_THREADS=1), one after
the other, both through the Python API (``bridge.quantize_params``; :mod:`distributed_worker`).

Reported per method: the seconds of the quantization call and of the whole process (launch to the quantized tree
on every rank: interpreter, imports, model load included; the evaluation after it is not), their ratio
2-rank / 1-process (goal <= 0.8), the share of quantized codes equal between the two trees (goal >= 99.9 %) and
of tensors bit-identical (codes, scales, zero points), the perplexity of each on 16x512 evaluation tokens
(goal: within 0.2 %), the load average while each ran; the time split of each rank (exclusive seconds of the
library's functions, timed by wrapping them in the worker); and from those parts, on paper, GPTQ on
Llama-3-8B on 1/2/4/8 ranks of this CPU beside llm-compressor's published GPU table
(:mod:`distributed_projection`).

    .venv/bin/python bench/bench_distributed.py [--quick] [--only gptq4-g64]

``--quick``: 4x128 calibration tokens, 2x128 evaluation tokens (a smoke run; its results go to
``distributed_quick.*``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

from common import RESULTS, markdown, write
import distributed_projection as proj

HERE = pathlib.Path(__file__).parent
WORKER = HERE / "distributed_worker.py"
PRESETS = ("gptq4-g64", "awq4-g64")
LABELS = {"capture": "embedding (first block's inputs)", "forward": "forward passes, calibration (with hooks)",
          "hessian": "Hessian accumulation", "init": "GPTQ group init (clip search)",
          "solve": "GPTQ solves (factorization, columns)", "awq_scales": "AWQ scale search (candidate forwards)",
          "awq_clip": "AWQ clip search (each linear on its owner)", "step": "step bookkeeping (pack, dequantize)",
          "outputs": "forward passes, block outputs (quantized)", "comm": "communication (collectives)",
          "wait": "waiting for the other rank (imbalance)", "other": "rest (plan, extract, tree)"}


def launch(preset: str, world: int, a, out: pathlib.Path) -> dict:
    """One run in a fresh process (or ``world`` ranks under torchrun); its result with the wall time and the
    load average sampled while it ran."""
    threads = 2 if world == 1 else 1
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "TQDM_DISABLE": "1"}
    args = [str(WORKER), "--preset", preset, "--threads", str(threads), "--calib", str(a.calib),
            "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--eval", str(a.eval), "--out", str(out),
            "--eval-threads", "2"]
    if world == 1 and a.float:
        args.append("--float")
    cmd = [sys.executable, *args] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *args]
    launched = time.time()
    cmd += ["--launched", repr(launched)]
    loads = [os.getloadavg()[0]]
    with open(out.with_suffix(".log"), "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        while p.poll() is None:
            time.sleep(2)
            loads.append(os.getloadavg()[0])
    if p.returncode != 0 or not (out / "result.json").is_file():
        tail = out.with_suffix(".log").read_text()[-2000:]
        raise RuntimeError(f"{preset} on {world} process(es) failed ({p.returncode}):\n{tail}")
    r = json.loads((out / "result.json").read_text())
    r["wall_s"] = time.time() - launched
    r["load"] = {"start": loads[0], "max": max(loads), "mean": sum(loads) / len(loads)}
    return r


def compare(one: pathlib.Path, two: pathlib.Path) -> dict:
    """Codes equal (count and share) and tensors bit-identical (codes, scales, zero points) between two runs."""
    a, b = torch.load(one / "codes.pt"), torch.load(two / "codes.pt")
    if a.keys() != b.keys():
        raise RuntimeError(f"the two runs quantized different tensors: {sorted(a.keys() ^ b.keys())[:4]}")
    equal = total = same = 0
    for p in a:
        x, y = a[p], b[p]
        equal += int((x["codes"] == y["codes"]).sum())
        total += x["codes"].numel()
        same += all(torch.equal(x[k], y[k]) if x[k] is not None else y[k] is None for k in x)
    return {"codes_equal": equal, "codes": total, "codes_pct": 100.0 * equal / total, "tensors_identical": same,
            "tensors": len(a)}


def run_method(preset: str, a, tmp: pathlib.Path) -> dict:
    runs = {}
    for world in (1, 2):
        print(f"{preset}: {world} process(es)...", flush=True)
        runs[world] = launch(preset, world, a, tmp / f"{preset}-{world}")
        r = runs[world]
        print(f"  quantize {r['quant_s']:.1f} s, process {r['process_s']:.1f} s, ppl {r['ppl']:.4f}, "
              f"load {r['load']['mean']:.2f} (max {r['load']['max']:.2f})", flush=True)
    same = compare(tmp / f"{preset}-1", tmp / f"{preset}-2")
    one, two = runs[1], runs[2]
    row = {"preset": preset, "one": one, "two": two, **same,
           "quant_ratio": two["quant_s"] / one["quant_s"], "process_ratio": two["process_s"] / one["process_s"],
           "ppl_diff_pct": 100.0 * (two["ppl"] - one["ppl"]) / one["ppl"]}
    print(json.dumps({k: v for k, v in row.items() if k not in ("one", "two")}), flush=True)
    return row


def summary(rows: list[dict]) -> str:
    return markdown(
        ["method", "quantize, 1 proc x 2 threads (s)", "quantize, 2 ranks x 1 thread (s)", "ratio (goal <= 0.8)",
         "whole process 1 / 2 (s)", "ratio", "codes equal (goal >= 99.9 %)", "tensors bit-identical",
         "perplexity 1 / 2", "difference", "load average (mean, max) 1 / 2"],
        [[r["preset"], f"{r['one']['quant_s']:.1f}", f"{r['two']['quant_s']:.1f}", f"{r['quant_ratio']:.2f}",
          f"{r['one']['process_s']:.1f} / {r['two']['process_s']:.1f}", f"{r['process_ratio']:.2f}",
          f"{r['codes_pct']:.3f} %", f"{r['tensors_identical']}/{r['tensors']}",
          f"{r['one']['ppl']:.4f} / {r['two']['ppl']:.4f}", f"{r['ppl_diff_pct']:+.3f} %",
          f"{r['one']['load']['mean']:.1f}, {r['one']['load']['max']:.1f} / "
          f"{r['two']['load']['mean']:.1f}, {r['two']['load']['max']:.1f}"] for r in rows])


def split(rows: list[dict]) -> str:
    """Each part's exclusive seconds: the one process, and each rank of the two."""
    cols, header = [], ["part"]
    for r in rows:
        cols.append(r["one"]["ranks"][0]["parts"])
        header.append(f"{r['preset']} 1 proc")
        for rk in r["two"]["ranks"]:
            cols.append(rk["parts"])
            header.append(f"{r['preset']} rank {rk['rank']}")
    lines = [[LABELS[k], *(f"{c[k]:.1f}" for c in cols)] for k in LABELS if any(c[k] > 0.05 for c in cols)]
    lines.append(["quantize call (total)", *(f"{x:.1f}" for r in rows for x in (
        r["one"]["ranks"][0]["quant_s"], *(rk["quant_s"] for rk in r["two"]["ranks"])))])
    return markdown(header, lines)


def solves(rows: list[dict]) -> str:
    """GPTQ's shared solves by kind: count, seconds (init included) and init seconds, per run and rank."""
    out = []
    for r in rows:
        for label, ranks in (("1 proc", r["one"]["ranks"]), ("2 ranks", r["two"]["ranks"])):
            for rk in ranks:
                for kind, (n, s, init) in rk.get("sets", {}).items():
                    out.append([r["preset"], f"{label}, rank {rk['rank']}", kind, n, f"{s:.1f}", f"{init:.1f}"])
    return markdown(["method", "run", "solve (shared input)", "count", "seconds", "of which init"], out) if out else ""


def projection(row: dict, a) -> tuple[str, list[dict]]:
    """Llama-3-8B on 1/2/4/8 ranks of this CPU from the 2-rank GPTQ run's parts (see distributed_projection)."""
    ranks = row["two"]["ranks"]
    tot = {k: sum(rk["parts"][k] for rk in ranks) for k in ranks[0]["parts"]}
    parts = {"forward": tot["capture"] + tot["forward"] + tot["outputs"], "hessian": tot["hessian"],
             "solve": tot["solve"], "init": tot["init"] + tot["step"], "comm": max(rk["parts"]["comm"] for rk in ranks)}
    tokens = a.calib * a.seq_len
    rate = proj.rates(parts, proj.SMOLLM2, tokens)
    out, table = [], []
    for n in (1, 2, 4, 8):
        t = proj.project(rate, proj.LLAMA3_8B, tokens, n)
        small = proj.project(rate, proj.SMOLLM2, tokens, n)
        out.append({"ranks": n, **t, "smollm2_model": small["total"]})
        table.append([n, f"{t['forward']:.0f}", f"{t['hessian']:.0f}", f"{t['solves']:.0f}", f"{t['comm']:.0f}",
                      f"{t['total']:.0f}", f"{t['solve_share']:.2f}", proj.LLMC_TABLE.get(n, "-"),
                      f"{small['total']:.1f}"])
    text = markdown(["ranks (1 core each)", "forward", "Hessians", "solves + init (busiest rank)", "communication",
                     "projected total (s)", "busiest rank's share of solves", "llm-compressor, GPUs (published, s)",
                     "same model on SmolLM2 (s)"], table)
    text += ("\n\nPROJECTION on this CPU (one core per rank), not a measurement: T(N) = (F·tokens·P + "
             "H·tokens·ΣD²)·L/N + L·max_r Σ_{solves of r} (S·(d_in³ + d_out·d_in²) + I·d_out·d_in) + "
             "C·bytes·L·ceil(log2 N), with P a layer's linear parameters, D each shared input's width, L the "
             f"layers, {tokens} calibration tokens, owners by the library's LPT on d_in³ + d_out·d_in². Rates "
             f"measured on SmolLM2 (2 ranks, summed): F = {rate['forward']:.3g} s per token·param, "
             f"H = {rate['hessian']:.3g} s per token·D², S = {rate['solve']:.3g} s per cost unit, "
             f"I = {rate['init']:.3g} s per weight element, C = {rate['comm']:.3g} s per byte (Hessians in "
             "float64 + packed codes). The forward and Hessian terms grow linearly with the calibration tokens; "
             "attention's tokens² term and BLAS efficiency at Llama's sizes are not modelled. llm-compressor's "
             "figures are GPUs and their own calibration set.")
    return text, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="calibration sequences per batch (AWQ's 2048 tokens: 2 "
                    "batches of 2x512, one per rank)")
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--only", nargs="*", default=None, choices=PRESETS)
    ap.add_argument("--quick", action="store_true", help="4x128 calibration, 2x128 evaluation tokens")
    ap.add_argument("--float", action="store_true", help="also the float model's perplexity (1-process runs)")
    a = ap.parse_args()
    if a.quick:
        a.calib, a.seq_len, a.eval, a.batch = 4, 128, 2, 1
    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for preset in a.only or PRESETS:
            rows.append(run_method(preset, a, pathlib.Path(d)))
            report(rows, a, load0)  # after each method: a run stopped later keeps what it measured


def report(rows: list[dict], a, load0) -> None:
    """Write the results of ``rows`` (with ``--only``: and the other methods' rows of the last full-size run)."""
    name = "distributed_quick" if a.quick else "distributed"
    old = RESULTS / f"{name}.json"
    if a.only and old.is_file():
        done = {r["preset"] for r in rows}
        rows = [r for r in json.loads(old.read_text())["rows"] if r["preset"] not in done] + rows
        rows.sort(key=lambda r: PRESETS.index(r["preset"]))
    text = summary(rows) + "\n\nTime split (exclusive seconds of each part, by rank):\n\n" + split(rows)
    more = solves(rows)
    if more:
        text += "\n\nGPTQ's shared solves (the owners: LPT on d_in³ + d_out·d_in²):\n\n" + more
    extra = {"load_average_start": load0, "load_average_end": os.getloadavg(), "calib": a.calib,
             "seq_len": a.seq_len, "batch": a.batch, "eval": a.eval}
    gptq = next((r for r in rows if r["preset"].startswith("gptq")), None)
    if gptq is not None:
        ptext, extra["projection"] = projection(gptq, a)
        text += "\n\nGPTQ on Llama-3-8B, projected from the parts above:\n\n" + ptext
    text += (f"\n\n{a.calib}x{a.seq_len} calibration tokens in batches of {a.batch}, {a.eval}x{a.seq_len} evaluation "
             f"tokens; 1 process x 2 threads vs torchrun --nproc-per-node 2 x 1 thread (gloo); load average "
             f"{load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 = this bench alone; the load "
             f"while each run ran is in the first table)")
    write(name, rows, text, extra)

if __name__ == "__main__":
    main()
