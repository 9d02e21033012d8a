"""Mixed-precision search on the default model (SmolLM2-135M-Instruct): at budgets of 3.0, 3.5, 4.25 and 5.0
bits per weight (of the linear weights, scales and zero points counted; lm_head/embeddings untouched), the
perplexity ratio (quantized / float, the built-in corpus's evaluation part) of the searched recipe against the
uniform schemes: the best one within the budget, and the smallest one of equal or larger size than the searched
recipe. The quantized model's stored bytes are checked against the search's prediction. Also: the search's
wall time (calibration pass + scoring + knapsack) against one GPTQ run (uint4-g64, same calibration), and the
rank correlation of the cheap estimate with the KL reference on a subset of layers. The default estimate is the
Fisher-weighted output error (a KL estimate, one scale across layers); each budget is also searched with the plain
output error tr(E H Eᵀ) of the same Hessians (``hessian``), to show what the Fisher weighting buys.

    .venv/bin/python bench/bench_search.py [--calib 16] [--eval 8] [--algorithm rtn] [--reference-layers 6]
        [--candidates A,B,...] [--estimate fisher|hessian]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import qtransform as qt
import bridge
from bridge import search as bsearch
from bridge.app import corpus, evaluate, models
from qtransform import search as qsearch

from common import markdown, write

BUDGETS = (3.0, 3.5, 4.25, 5.0)


def ppl_ratio(model, recipe, ev, fp) -> float:
    with torch.no_grad():
        qm = bridge.quantize(model, recipe, kernel="dequant")
        return evaluate.perplexity(qm, ev).perplexity / fp


def hessian_losses(model, sens, cands, algorithm) -> dict:
    """The plain output error tr(E H Eᵀ) of every (layer, candidate) the search scored, from the same Hessians."""
    tree = bridge.tree.extract(model)
    out = {}
    for p, scored in sens.losses.items():
        w, h = tree[p].detach().float(), sens.hessians[p].float()
        out[p] = {c.name: qsearch.output_error(w, qsearch.quantized_weight(w, c.spec, algorithm=algorithm, h=h, path=p), h)
                  for c in cands if c.name in scored}
    return out


def gptq_seconds(model, cal) -> float:
    """One GPTQ run (uint4 g64 asymmetric, every linear but the head) on the calibration batches."""
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False, pad=True)
    t = time.perf_counter()
    with torch.no_grad():
        bridge.quantize(model, qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"], steps=[qt.Step("gptq")]),
                        calibration=list(cal.split(4)), kernel="dequant")
    return time.perf_counter() - t


def time_only(a, model, cal, cands) -> None:
    """The search's wall time (measure + the knapsack at every budget, the slowest solve counted), as shipped and
    with float32 products kept in float32 arithmetic (``exact_matmul``), against one GPTQ run on the same
    calibration, alternating ``a.time_only`` times; the medians and their ratios."""
    load = os.getloadavg()[0]
    runs = []
    for _ in range(a.time_only):
        run = {}
        for key, exact in (("measure_s", False), ("measure_exact_s", True)):
            t = time.perf_counter()
            with torch.no_grad():
                sens = bsearch.measure(model, list(cal.split(4)), cands, algorithm=a.algorithm, estimate=a.estimate,
                                       exact_matmul=exact)
            run[key] = time.perf_counter() - t
        solves = []
        for budget in BUDGETS:
            t = time.perf_counter()
            try:
                qsearch.search(sens.layers, cands, sens.losses, budget=budget, groups=sens.groups)
            except ValueError:  # below the smallest size these candidates reach
                continue
            solves.append(time.perf_counter() - t)
        run["solve_s"] = max(solves or [0.0])
        run.update(search_s=run["measure_s"] + run["solve_s"], search_exact_s=run["measure_exact_s"] + run["solve_s"],
                   gptq_s=gptq_seconds(model, cal), load=os.getloadavg()[0])
        runs.append(run)
        print(runs[-1], flush=True)
    keys = ("measure_s", "measure_exact_s", "solve_s", "search_s", "search_exact_s", "gptq_s")
    med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in keys}
    text = (markdown(["search (measure + slowest knapsack)", "knapsack", "search, float32 products exact",
                      "one GPTQ run (uint4 g64)", "ratio", "ratio, exact"],
                     [[f"{med['search_s']:.1f} s", f"{med['solve_s']:.2f} s", f"{med['search_exact_s']:.1f} s",
                       f"{med['gptq_s']:.1f} s", f"{med['search_s'] / med['gptq_s']:.2f}",
                       f"{med['search_exact_s'] / med['gptq_s']:.2f}"]])
            + f"\n\nmedians of {a.time_only} alternating runs; SmolLM2-135M, calibration {a.calib}x{a.seq_len} tokens "
              f"(the Fisher on {bsearch.FISHER_TOKENS} positions of them), "
              f"{len(cands)} candidates ({a.candidates}), estimate {a.estimate}, algorithm {a.algorithm}, "
              f"{a.threads} threads; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end. "
              "'exact': measure(exact_matmul=True), no oneDNN bf16 emulation of float32 products (GPTQ runs without "
              "it in both).\n\n"
              f"command: python {' '.join(sys.argv)}")
    write("search_time", runs, text, {"medians": med})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--eval", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--algorithm", default="rtn", choices=qsearch.SEARCH_ALGORITHMS)
    ap.add_argument("--reference-layers", type=int, default=6)
    ap.add_argument("--no-gptq", action="store_true", help="skip the GPTQ timing run")
    ap.add_argument("--candidates", default=",".join(qsearch.DEFAULT_CANDIDATES))
    ap.add_argument("--estimate", default="fisher", choices=bsearch.ESTIMATES)
    ap.add_argument("--time-only", type=int, default=0, metavar="N",
                    help="only time the search (measure + knapsack) against one GPTQ run, N times each, alternating; "
                         "written to bench/results/search_time.{json,md}")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load = os.getloadavg()[0]
    model, tok = models.load_with_tokenizer()
    model.eval()
    ev = corpus.token_sequences(corpus.load_text("builtin", part="eval"), tok, seq_len=a.seq_len, max_sequences=a.eval)
    cal = corpus.token_sequences(corpus.load_text("builtin", part="calibration"), tok, seq_len=a.seq_len,
                                 max_sequences=a.calib)
    with torch.no_grad():
        fp = evaluate.perplexity(model, ev).perplexity
    print(f"float perplexity {fp:.3f}", flush=True)

    cands = qsearch.candidates(a.candidates)
    if a.time_only:
        return time_only(a, model, cal, cands)
    t = time.perf_counter()
    with torch.no_grad():
        sens = bsearch.measure(model, list(cal.split(4)), cands, algorithm=a.algorithm, estimate=a.estimate)
    measure_s = time.perf_counter() - t
    plain = sens.losses if a.estimate == "hessian" else hessian_losses(model, sens, cands, a.algorithm)
    numel = sum(r * c for r, c in sens.layers.values())
    steps = (a.algorithm,)
    print(f"measured {len(sens.layers)} layers x {len(cands)} candidates in {measure_s:.1f} s", flush=True)

    uniform = {}
    for c in cands:  # every uniform scheme, quantized by the same algorithm
        recipe = qsearch.search_recipe(qsearch.search(sens.layers, [c], sens.losses, budget=64.0,
                                                      groups=sens.groups), steps=steps)
        size = sum(qsearch.tensor_bytes(c.spec, s) for s in sens.layers.values())
        uniform[c.name] = {"bits": 8 * size / numel, "bytes": size, "ratio": ppl_ratio(model, recipe, ev, fp),
                           "estimate": sum(sens.losses[p][c.name] for p in sens.layers)}
        print(c.name, uniform[c.name], flush=True)

    rows = []
    for budget, estimate in [(b, e) for b in BUDGETS for e in dict.fromkeys((a.estimate, "hessian"))]:
        t = time.perf_counter()
        r = qsearch.search(sens.layers, cands, sens.losses if estimate == a.estimate else plain, budget=budget,
                           groups=sens.groups)
        solve_s = time.perf_counter() - t
        recipe = qsearch.search_recipe(r, steps=steps)
        res = bridge.quantize_params(model, bridge.plan(model, recipe))
        stored = sum(v.nbytes() for v in res.qtree.values() if qt.is_qtensor(v))
        del res
        ratio = ppl_ratio(model, recipe, ev, fp)
        within = [(u["ratio"], n) for n, u in uniform.items() if u["bytes"] <= r.budget]
        above = sorted((u["bytes"], n) for n, u in uniform.items() if u["bytes"] >= r.size)
        counts = {}
        for n in r.choice.values():
            counts[n] = counts.get(n, 0) + 1
        row = {"budget": budget, "estimate": estimate, "bits": round(r.bits_per_weight, 4), "bytes": r.size, "stored": stored,
               "ratio": round(ratio, 4), "estimated_loss": r.loss, "solve_s": round(solve_s, 2), "exact": r.exact,
               "best_within": min(within) if within else None,
               "next_larger": (above[0][1], round(uniform[above[0][1]]["ratio"], 4)) if above else None,
               "schemes": counts}
        rows.append(row)
        print(row, flush=True)

    t = time.perf_counter()
    pairs = bsearch.spread_pairs(sens.losses, a.reference_layers)
    with torch.no_grad():
        ref = bsearch.kl_reference(model, list(ev[:1].split(1)), cands, pairs, sens.losses, algorithm=a.algorithm,
                                   hessians=sens.hessians)
    ref_s = time.perf_counter() - t
    print(f"KL reference: Spearman {ref.spearman:.3f} over {len(ref.kl)} pairs in {ref_s:.1f} s", flush=True)

    gptq_s = None
    if not a.no_gptq:
        gptq_s = gptq_seconds(model, cal)
        print(f"GPTQ uint4-g64: {gptq_s:.1f} s", flush=True)

    fmt = lambda x: "-" if x is None else f"{x[1]} x{x[0]:.4f}" if isinstance(x[0], float) else f"{x[0]} x{x[1]:.4f}"  # noqa: E731
    table = markdown(["budget (bits/weight)", "estimate", "searched: bits", "searched: ppl ratio", "stored = predicted bytes",
                      "best uniform within budget", "smallest uniform of equal or larger size", "schemes chosen"],
                     [[r["budget"], r["estimate"], r["bits"], f"x{r['ratio']:.4f}", "yes" if r["stored"] == r["bytes"] else "NO",
                       fmt(r["best_within"]), fmt(r["next_larger"]),
                       ", ".join(f"{n} {k}" for n, k in sorted(r["schemes"].items()))] for r in rows])
    table += "\n\n" + markdown(["uniform scheme", "bits/weight", "ppl ratio", "estimated loss"],
                               [[n, f"{u['bits']:.4f}", f"x{u['ratio']:.4f}", f"{u['estimate']:.4g}"]
                                for n, u in sorted(uniform.items(), key=lambda kv: kv[1]["bytes"])])
    search_s = measure_s + max(r["solve_s"] for r in rows if r["estimate"] == a.estimate)
    table += (f"\n\nfloat perplexity {fp:.3f} on {ev.numel()} tokens; calibration {a.calib}x{a.seq_len} tokens; "
              f"algorithm {a.algorithm} (search and quantization); {len(sens.layers)} linear layers, "
              f"q/k/v and gate/up sharing a scheme.\n"
              f"search wall time {search_s:.1f} s (calibration pass and scoring {measure_s:.1f} s, knapsack "
              f"<= {max(r['solve_s'] for r in rows):.2f} s)"
              + (f"; one GPTQ run (uint4-g64, same calibration) {gptq_s:.1f} s: ratio {search_s / gptq_s:.2f}"
                 if gptq_s else "")
              + f".\nKL reference: Spearman rank correlation of the estimate with the KL divergence "
              f"{ref.spearman:.3f} over {len(ref.kl)} (layer, candidate) pairs ({a.reference_layers} layers x "
              f"{len(cands)} candidates, {ref.tokens} held-out tokens, {ref_s:.0f} s).\n"
              f"{a.threads} threads; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
              "(2 cores shared with other sessions).")
    write("search", rows, table, {"uniform": uniform, "measure_s": measure_s, "gptq_s": gptq_s,
                                  "spearman": ref.spearman, "kl": [[p, c, v, ref.estimate[(p, c)]]
                                                                   for (p, c), v in ref.kl.items()]})


if __name__ == "__main__":
    main()
