"""Mixed precision on the default model (SmolLM2-135M-Instruct), side by side with intel's AutoRound AutoScheme
(issue 34): at budgets of 3.0, 3.5, 4.25 and 5.0 bits per weight, the perplexity ratio (quantized / float, the
built-in corpus's evaluation part) of AutoScheme's recipe and of ``qtransform search``'s, both over the same
candidate widths, both applied by round to nearest, calibrated on the same tokens of the calibration part, with
the bits per weight of each recipe counted our way (codes + every scale and zero point at its stored width,
:func:`qtransform.search.tensor_bytes`) and the seconds of each.

The candidates: auto-round's ``W2A16, W3A16, W4A16, W8A16`` are symmetric signed integers in groups of 128 along
the input features with float16 scales (``int_sym``; its RTN maps the largest magnitude of a group to
``-2^(N-1)``, our ``"full"`` symmetric range maps it to ``±(2^N - 1) / 2``: the same storage, other grids).
Ours, twice: the same widths with float16 scales (``intN-g128`` with ``scale_dtype="float16"``, named
``intN-g128-f16``: the exact stored form), and our candidate names ``int2-g128, int3-g128, int4-g128, int8-g128``
as they are (float32 scales: 1/8 bit per weight more at every width). Our search shares one scheme among q/k/v
and among gate/up (what a fused vLLM kernel needs); AutoScheme, run with its defaults, does not.

AutoScheme runs in auto-round's virtualenv (bench/peer_autoscheme.py, ``--peer-python``), its target
``avg_bits`` being the budget in its own count (codes + a 16-bit scale + a ``bits``-bit zero point per group,
the zero point counted also for symmetric schemes); its recipe is then recounted our way here.

    .venv/bin/python bench/bench_autoscheme.py [--peer-python /tmp/qtransform-autoround/bin/python]
        [--calib 16] [--eval 8] [--seq-len 512] [--threads 2] [--budgets 3.0 3.5 4.25 5.0] [--no-peer]
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

import qtransform as qt
import bridge
from bridge import search as bsearch
from bridge.app import evaluate
from qtransform import search as qsearch

from bench_gptq import arguments, setup
from common import machine, markdown, write

HERE = pathlib.Path(__file__).parent
BUDGETS = (3.0, 3.5, 4.25, 5.0)
PEER_PYTHON = "/tmp/qtransform-autoround/bin/python"
#: auto-round's options and the widths they hold (symmetric int, group 128, float16 scales).
OPTIONS = {"W2A16": 2, "W3A16": 3, "W4A16": 4, "W8A16": 8}


def f16(name: str) -> qsearch.Candidate:
    """Our ``name`` (``intN-gG``) with float16 scales, named ``name-f16``."""
    c = qsearch.candidate(name)
    return qsearch.Candidate(f"{name}-f16", dataclasses.replace(c.spec, scale_dtype="float16"))


def candidate_sets() -> dict[str, tuple[qsearch.Candidate, ...]]:
    names = [f"int{b}-g128" for b in OPTIONS.values()]
    return {"f16 scales": tuple(f16(n) for n in names), "our names": qsearch.candidates(names)}


def ppl_of(model, recipe, ev) -> tuple[float, float]:
    """(perplexity of ``model`` quantized by ``recipe``, seconds of the quantization call)."""
    t = time.perf_counter()
    with torch.no_grad():
        qm = bridge.quantize(model, recipe, kernel="dequant")
    seconds = time.perf_counter() - t
    with torch.no_grad():
        return evaluate.perplexity(qm, ev).perplexity, seconds


def ours(model, cal, ev, fp, cands, budgets) -> tuple[list[dict], dict]:
    """Our search over ``cands`` at each budget: one measurement, one knapsack and one quantization per budget."""
    t = time.perf_counter()
    with torch.no_grad():
        sens = bsearch.measure(model, list(cal.split(4)), cands, algorithm="rtn", estimate="fisher")
    measure_s = time.perf_counter() - t
    print(f"measured {len(sens.layers)} layers x {len(cands)} candidates in {measure_s:.1f} s", flush=True)
    rows = []
    for budget in budgets:
        t = time.perf_counter()
        r = qsearch.search(sens.layers, cands, sens.losses, budget=budget, groups=sens.groups)
        solve_s = time.perf_counter() - t
        recipe = qsearch.search_recipe(r, steps=("rtn",))
        ppl, quant_s = ppl_of(model, recipe, ev)
        counts = {}
        for n in r.choice.values():
            counts[n] = counts.get(n, 0) + 1
        rows.append({"budget": budget, "bits": r.bits_per_weight, "bytes": r.size, "ppl": ppl, "ratio": ppl / fp,
                     "search_s": measure_s + solve_s, "solve_s": solve_s, "quantize_s": quant_s, "schemes": counts,
                     "choice": r.choice})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "choice"}), flush=True)
    return rows, {"layers": sens.layers, "measure_s": measure_s}


def uniform(model, ev, fp, cands, layers) -> dict:
    """Each candidate on every searched layer (RTN): bits per weight and ppl ratio."""
    numel = sum(r * c for r, c in layers.values())
    out = {}
    for c in cands:
        recipe = qt.Recipe(rules=[(p, c.spec) for p in layers], exclude=(), steps=("rtn",))
        size = sum(qsearch.tensor_bytes(c.spec, s) for s in layers.values())
        out[c.name] = {"bits": 8 * size / numel, "ratio": ppl_of(model, recipe, ev)[0] / fp}
        print(c.name, out[c.name], flush=True)
    return out


def recount(peer_layers: dict, layers: dict) -> tuple[float, int, dict]:
    """AutoScheme's recipe in our terms: bits per weight and bytes counted our way, and ``{path: spec}`` (each
    layer's chosen width as our symmetric int with float16 scales in its chosen group size, ``tensor_bytes``)."""
    size, specs = 0, {}
    for path, shape in layers.items():
        lay = peer_layers[path.removesuffix(".weight")]
        if not lay["sym"]:
            raise ValueError(f"{path}: AutoScheme chose an asymmetric scheme; this bench counts symmetric ones")
        specs[path] = qt.QuantSpec(format=f"int{lay['bits']}", granularity=qt.PerGroup(lay["group_size"]),
                                   symmetric=True, scale_dtype="float16", pad=True)
        size += qsearch.tensor_bytes(specs[path], shape)
    return 8 * size / sum(r * c for r, c in layers.values()), size, specs


def peer(python: str, files, budget: float, threads: int, batch_size: int) -> dict | None:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        cmd = [python, str(HERE / "peer_autoscheme.py"), "--model", files[2], "--tokens", files[0], "--eval", files[1],
               "--avg-bits", repr(budget), "--options", ",".join(OPTIONS), "--threads", str(threads),
               "--batch-size", str(batch_size), "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                       "HF_DATASETS_OFFLINE": "1"})
        if done.returncode != 0 or not os.path.exists(out):
            print(f"AutoScheme {budget}: failed ({done.returncode}): {done.stderr.strip()[-1500:]}", flush=True)
            return {"error": done.stderr.strip()[-1500:], "returncode": done.returncode}
        return json.loads(pathlib.Path(out).read_text())


def counts_text(counts: dict) -> str:
    return ", ".join(f"{n} {k}" for n, k in sorted(counts.items()))


def main() -> None:
    ap = arguments({})
    ap.set_defaults(calib=16, eval=8, peer_python=PEER_PYTHON)
    ap.add_argument("--budgets", type=float, nargs="*", default=list(BUDGETS))
    ap.add_argument("--peer-batch", type=int, default=4, help="calibration rows per AutoScheme step")
    ap.add_argument("--no-peer", action="store_true")
    a = ap.parse_args()
    if a.no_peer:
        a.peer_python = None
    load = os.getloadavg()
    model, cal, ev, fp, files = setup(a)
    print(f"float perplexity {fp:.3f}", flush=True)
    sets, results, refs = candidate_sets(), {}, {}
    for key, cands in sets.items():
        results[key], info = ours(model, cal, ev, fp, cands, a.budgets)
        results[key + " measure_s"] = info["measure_s"]
        layers = info["layers"]
    refs = uniform(model, ev, fp, sets["f16 scales"], layers)
    peers = {}
    for budget in a.budgets if a.peer_python else ():
        p = peer(a.peer_python, files, budget, a.threads, a.peer_batch)
        if "error" not in p:
            p["bits_recount"], p["bytes_recount"], specs = recount(p["layers"], layers)
            ppl, _ = ppl_of(model, qt.Recipe(rules=list(specs.items()), exclude=(), steps=("rtn",)), ev)
            p["ratio_our_rtn"] = ppl / fp  # its recipe, quantized by our RTN (our grid)
            counts = {}
            for v in p["layers"].values():
                n = f"W{v['bits']}A16 g{v['group_size']}"
                counts[n] = counts.get(n, 0) + 1
            p["schemes"] = counts
            print(json.dumps({k: p[k] for k in ("avg_bits", "ppl", "ratio_our_rtn", "seconds", "search_seconds", "bits_ours",
                                                "bits_recount", "bits_autoround", "schemes")}), flush=True)
        peers[budget] = p
    end_load = os.getloadavg()

    rows, lines = [], []
    for i, budget in enumerate(a.budgets):
        f, n, p = results["f16 scales"][i], results["our names"][i], peers.get(budget)
        row = {"budget": budget, "ours_f16": {k: v for k, v in f.items() if k != "choice"},
               "ours_names": {k: v for k, v in n.items() if k != "choice"},
               "ours_f16_choice": f["choice"], "ours_names_choice": n["choice"]}
        if p is not None:
            row["autoscheme"] = p
        rows.append(row)
        ok = p is not None and "error" not in p
        lines.append([budget,
                      f"x{p['ppl'] / fp:.4f}" if ok else "-", f"x{p['ratio_our_rtn']:.4f}" if ok else "-",
                      f"{p['bits_recount']:.4f}" if ok else "-",
                      f"{p['bits_autoround']:.4f}" if ok else "-",
                      (f"{p['search_seconds']:.0f}" + (" (cached scores)" if p.get("scores_cached") else "")
                       + f" / {p['seconds']:.0f}") if ok else "-",
                      counts_text(p["schemes"]) if ok else (p or {}).get("error", "not run")[-120:],
                      f"x{f['ratio']:.4f}", f"{f['bits']:.4f}", f"{f['search_s']:.0f} / {f['search_s'] + f['quantize_s']:.0f}",
                      counts_text(f["schemes"]),
                      f"x{n['ratio']:.4f}", f"{n['bits']:.4f}"])
    table = markdown(["budget (bits/weight)", "AutoScheme: ppl ratio", "AutoScheme's recipe, our RTN: ppl ratio",
                      "AutoScheme: bits (ours)",
                      "AutoScheme: bits (auto-round's count)", "AutoScheme: s (search / all)", "AutoScheme: layers",
                      "ours, f16 scales: ppl ratio", "ours f16: bits", "ours f16: s (search / all)", "ours f16: layers",
                      "ours, our names (fp32 scales): ppl ratio", "ours names: bits"], lines)
    table += "\n\n" + markdown(["uniform (RTN, every searched layer)", "bits/weight (ours)", "ppl ratio"],
                               [[k, f"{u['bits']:.4f}", f"x{u['ratio']:.4f}"] for k, u in refs.items()])
    info = machine()
    table += (f"\n\nfloat perplexity {fp:.3f} on {ev.numel()} tokens; calibration {a.calib}x{a.seq_len} tokens (the "
              f"same ids on both sides; AutoScheme in batches of {a.peer_batch}); {len(layers)} linear layers "
              f"(lm_head and embeddings untouched). Both apply the chosen schemes by plain round to nearest "
              f"(auto-round: iters=0, disable_opt_rtn). Seconds: 'search' is ours measure + knapsack "
              f"(measurement shared by the budgets, {results['f16 scales measure_s']:.0f} s) and AutoScheme's "
              f"scoring + DP (its scores cached by the first budget's run, reused by the others); 'all' adds the quantization (ours) or is AutoRound's whole quantize() call "
              f"(scoring, DP, calibration forward, RTN). {a.threads} threads; {info['cpu']}, torch {info['torch']}; "
              f"load average {load[0]:.1f} at the start, {end_load[0]:.1f} at the end (2 cores shared with other "
              f"sessions).\n\ncommand: python {' '.join(sys.argv)}")
    write("autoscheme", rows, table, {"fp_ppl": fp, "uniform": refs, "calib": a.calib, "eval": a.eval,
                                      "seq_len": a.seq_len, "threads": a.threads, "load_start": load,
                                      "load_end": end_load, "command": " ".join(["python", *sys.argv]),
                                      "measure_s": {k: results[k + " measure_s"] for k in sets}})


if __name__ == "__main__":
    main()
