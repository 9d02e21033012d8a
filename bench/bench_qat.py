"""Quantization-aware training on the default model (SmolLM2-135M-Instruct), side by side with torchao's QAT: the
perplexity ratio quantized / float on held-out text of another corpus (``out/corpora/thirdparty_docstrings.txt``,
bench/build_corpora.py) and on the built-in corpus's evaluation part, training/calibration on 40x512 tokens of the
built-in corpus's calibration part; the seconds of the quantization call, the peak resident memory of the row's own
process (each row runs in a process of its own, one after the other, same tokens and threads) and the training
tokens. Widths: bench_signround's SCHEMES (uint4 g128, uint3 g64, uint2 g64, asymmetric, integer zero point), and
W4A4 (``w4a4-quarot``: the ``quarot-w4a4`` preset's recipe, int4 per-channel weights, int4 per-token dynamic inputs,
its Hadamard rotations first: each row's steps run after ``rotate``, so "gptq" is the preset itself and "qat_gptaq"
trains under the rotated model's activation quantizers).

Rows: RTN, GPTQ, GPTAQ, SignRound from GPTAQ, QAT (Block-AP) from GPTAQ and from RTN (min-max), and torchao's QAT
(bench/peer_torchao_qat.py, in its own virtualenv: ``make bench-qat-peer``) with its integer zero point (its config's
default) and with its float zero point. Every learned row runs at each ``--iters`` budget (the token-budget curve).

Equal steps: our ``qat`` step gives every weight ``iters`` Adam updates of ``batch_size`` sequences (block by block,
against the float block's output); torchao gets ``iters`` Adam updates of the whole model, ``batch_size`` sequences
each, next-token loss. Training tokens = ``iters x batch_size x seq_len`` on both sides (per block for ours, through
the whole model for torchao's).

    .venv/bin/python bench/bench_qat.py [--peer-python PY] [--iters 25 50 100] [--batch-size 4] [--peer-lr 2e-5]
        [--only uint2-asym-g64 ...] [--methods rtn qat_gptaq torchao ...] [--other-corpus FILE] [--layers 2]

``--layers N`` keeps the first N decoder layers (smoke runs only). Rows of earlier runs that this run did not repeat
are kept (bench/results/qat.json); the tables go to bench/results/qat.md and docs/qat_bench.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import torch

import qtransform as qt

from bench_gptq import save_float
from bench_signround import SCHEMES, spec_of, unavailable
from common import RESULTS, machine, markdown, write

HERE = pathlib.Path(__file__).parent
DOCS = HERE.parent / "docs" / "qat_bench.md"
OTHER = HERE.parent / "out" / "corpora" / "thirdparty_docstrings.txt"
BASES = {"rtn": "RTN", "gptq": "GPTQ", "gptaq": "GPTAQ", "signround_gptaq": "SignRound from GPTAQ",
         "qat_gptaq": "QAT (Block-AP) from GPTAQ", "qat_minmax": "QAT (Block-AP) from RTN",
         "torchao": "torchao QAT, integer zero point", "torchao_fzp": "torchao QAT, float zero point"}
METHODS = list(BASES)
#: the rows that train: one per --iters budget
LEARNED = ("signround_gptaq", "qat_gptaq", "qat_minmax", "torchao", "torchao_fzp")
#: torchao's rows -> its fake quantizer's zero point domain
PEER = {"torchao": "int", "torchao_fzp": "float"}
#: W4A4: the quarot-w4a4 preset's recipe, each row's steps after its rotation
W4A4 = "w4a4-quarot"
ALL_SCHEMES = [*SCHEMES, W4A4]


def recipe_of(scheme: str, steps: list[qt.Step]) -> qt.Recipe:
    """The recipe of one of our rows: weight-only ``scheme`` with ``steps``, or W4A4 with ``rotate`` first."""
    if scheme == W4A4:
        return dataclasses.replace(qt.get_preset("quarot-w4a4").recipe, steps=[qt.Step("rotate"), *steps])
    return qt.Recipe(type_rules={"Linear": spec_of(scheme)}, exclude=["lm_head*"], steps=steps)


def steps_of(method: str, *, iters: int, batch_size: int) -> list[qt.Step]:
    """The recipe steps of one of our rows (``METHODS`` but torchao's)."""
    learned = dict(iters=iters, batch_size=batch_size)
    table = {"rtn": [], "gptq": [qt.Step("gptq")], "gptaq": [qt.Step("gptq", gptaq=True)],
             "signround_gptaq": [qt.Step("signround", init="gptaq", **learned)],
             "qat_gptaq": [qt.Step("qat", init="gptaq", **learned)],
             "qat_minmax": [qt.Step("qat", init="minmax", **learned)]}
    if method not in table:
        raise ValueError(f"--methods: unknown method {method!r}; known: {METHODS}")
    return table[method]


def jobs(schemes, methods, iters) -> list[tuple[str, str, int | None]]:
    """``(scheme, method, iters or None)`` in run order: every learned method at every budget."""
    return [(s, m, n) for s in schemes for m in methods for n in (iters if m in LEARNED else [None])]


def truncate(model, layers: int | None):
    """The model with its first ``layers`` decoder layers (all with None)."""
    if layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return model


def rss_gib(kib: int) -> float:
    return round(kib / 2 ** 20, 2)


def row_main(job_file: str) -> None:
    """One of our rows, in this process (``--row JOB.json``): load, quantize (timed), score, write the result."""
    import bridge
    from bridge.app import evaluate, models

    job = json.loads(pathlib.Path(job_file).read_text())
    torch.set_num_threads(job["threads"])
    model, _ = models.load_with_tokenizer()
    model = truncate(model.eval(), job["layers"])
    cal, evs = torch.load(job["calib"]), [torch.load(p) for p in job["eval"]]
    steps = steps_of(job["method"], iters=job["iters"] or 0, batch_size=job["batch_size"])
    recipe = recipe_of(job["scheme"], steps)
    load_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    with torch.no_grad():
        r = bridge.quantize_params(model, recipe, calibration=list(cal.split(job["batch_size"])))
        qm = bridge.to_module(model, r, kernel="dequant")
    seconds = time.perf_counter() - t
    with torch.no_grad():
        ppl = [evaluate.perplexity(qm, ev).perplexity for ev in evs]
    kept = [v["kept"] for v in r.info.values() if isinstance(v, dict) and "kept" in v]
    out = {"seconds": seconds, "ppl": ppl, "rss_load_kib": load_kib,
           "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
           **({"kept_trained": f"{kept.count('trained')}/{len(kept)}"} if kept else {})}
    pathlib.Path(job["out"]).write_text(json.dumps(out))


def run(cmd: list[str], out: str, what: str) -> dict | None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not os.path.exists(out):
        print(f"{what}: failed ({done.returncode}): {done.stderr.strip()[-800:]}", flush=True)
        return None
    return json.loads(pathlib.Path(out).read_text())


def peer_command(python: str, files: dict, scheme: str, method: str, *, iters: int, batch_size: int, lr: float,
                 threads: int, out: str) -> list[str]:
    """The command line of bench/peer_torchao_qat.py for one row."""
    bits, group = SCHEMES[scheme]
    return [python, str(HERE / "peer_torchao_qat.py"), "--model", files["model"], "--tokens", files["calib"],
            "--eval", *files["eval"], "--bits", str(bits), "--group-size", str(group), "--iters", str(iters),
            "--batch-size", str(batch_size), "--lr", repr(lr), "--zero-point", PEER[method], "--threads",
            str(threads), "--out", out]


def measure(files: dict, fp: list[float], a) -> tuple[list[dict], dict[str, str]]:
    """One row per job that ran or was refused, and ``{method: why}`` for those that cannot run here."""
    rows, skipped = [], {}
    seq_len = torch.load(files["calib"]).shape[1]
    for scheme, method, iters in jobs(a.only or ALL_SCHEMES, a.methods or METHODS, a.iters):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "result.json")
            if method in PEER:
                if scheme == W4A4:
                    skipped[method] = ("W4A4 is QuaRot's recipe (Hadamard rotations, int4 per-token inputs): torchao's "
                                       "QAT has no rotation, so no row of the same recipe")
                    continue
                if a.peer_python is None:
                    skipped[method] = "no --peer-python"
                    continue
                got = run(peer_command(a.peer_python, files, scheme, method, iters=iters, batch_size=a.batch_size,
                                       lr=a.peer_lr, threads=a.threads, out=out), out, f"{method} {scheme} {iters}")
            else:
                why = unavailable(steps_of(method, iters=iters or 1, batch_size=a.batch_size))
                if why is not None:
                    skipped[method] = why
                    print(f"{BASES[method]}: not available on this main ({why})", flush=True)
                    continue
                job = {"scheme": scheme, "method": method, "iters": iters, "batch_size": a.batch_size,
                       "threads": a.threads, "layers": a.layers, "calib": files["calib"], "eval": files["eval"],
                       "out": out}
                pathlib.Path(d, "job.json").write_text(json.dumps(job))
                me = str(pathlib.Path(__file__).resolve())
                got = run([sys.executable, me, "--row", str(pathlib.Path(d, "job.json"))], out,
                          f"{method} {scheme} {iters}")
        if got is not None and got.get("fp_ppl") and any(abs(p / f - 1) > 1e-3 for p, f in zip(got["fp_ppl"], fp)):
            print(f"{method} {scheme}: its float model scores {got['fp_ppl']}, ours {fp}: left out", flush=True)
            got = None
        if got is None:
            skipped[method] = "failed (see the log)"
            continue
        row = {"scheme": scheme, "method": method, "iters": iters,
               "tokens": (iters or 0) * a.batch_size * seq_len if method in LEARNED else 0,
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": round(os.getloadavg()[0], 1)}
        if "refused" in got:
            row["refused"] = got["refused"]
        else:
            row.update(ppl=[round(p, 3) for p in got["ppl"]], ratio=[round(p / f, 4) for p, f in zip(got["ppl"], fp)],
                       seconds=round(got["seconds"], 1), peak_gib=rss_gib(got["peak_kib"]),
                       load_gib=rss_gib(got["rss_load_kib"]))
        if method in LEARNED:
            row["settings"] = {"batch_size": a.batch_size, **({"lr": a.peer_lr} if method in PEER else {})}
        if "kept_trained" in got:
            row["kept_trained"] = got["kept_trained"]
        if method in PEER:
            row["peer"] = {k: got.get(k) for k in ("versions", "base_config_route", "max_distinct_per_group")}
            if got.get("losses"):
                row["peer"]["loss_first_last"] = [got["losses"][0], got["losses"][-1]]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows, skipped


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` with the rows of ``old`` whose (scheme, method, iters) it did not repeat, in table order."""
    key = {(r["scheme"], r["method"], r["iters"]): r for r in [*old, *new]}
    order = {m: i for i, m in enumerate(METHODS)}
    schemes = {s: i for i, s in enumerate(ALL_SCHEMES)}
    return sorted(key.values(), key=lambda r: (schemes.get(r["scheme"], 99), order.get(r["method"], 99),
                                               r["iters"] or 0))


def table(rows: list[dict], scheme: str) -> str:
    """One scheme's rows: ratios on both corpora, seconds, peak RSS, training tokens."""
    out = []
    for r in (r for r in rows if r["scheme"] == scheme):
        name = BASES.get(r["method"], r["method"])
        if r["method"] in PEER and r.get("settings", {}).get("lr") is not None:
            name += f" (lr {r['settings']['lr']:g})"
        if "refused" in r:
            out.append([name, r["iters"] or "-", r["tokens"] or "-", f"refused: {r['refused']}", "", "", "", ""])
            continue
        out.append([name, r["iters"] or "-", r["tokens"] or "-", *(f"x{x}" for x in r["ratio"]), r["seconds"],
                    f"{r['peak_gib']} ({r['load_gib']})", r.get("kept_trained", "")])
    return markdown(["method", "iters", "training tokens", "ppl ratio, third-party docstrings",
                     "ppl ratio, built-in eval", "seconds", "peak RSS GiB (after load)", "trained kept"], out)


def curve(rows: list[dict]) -> str:
    """The token-budget curve: each learned method and scheme down, each budget across (ratio on the other
    corpus)."""
    learned = [r for r in rows if r["method"] in LEARNED]
    budgets = sorted({r["iters"] for r in learned})
    cells = {(r["scheme"], r["method"], r["iters"]): "refused" if "refused" in r else f"x{r['ratio'][0]}"
             for r in learned}
    lines = [[BASES[m], s, *(cells.get((s, m, n), "-") for n in budgets)]
             for s in ALL_SCHEMES for m in LEARNED if any(k[:2] == (s, m) for k in cells)]
    return markdown(["method", "scheme", *(f"{n} it" for n in budgets)], lines)


PREFACE = """# QAT benchmark: Block-AP beside torchao's QAT

Written by `bench/bench_qat.py` (do not edit by hand; raw rows in `bench/results/qat.json`). SmolLM2-135M-Instruct,
weights only (and W4A4: the `quarot-w4a4` recipe, each row after its rotations), every linear layer but the head; perplexity ratio quantized / float on held-out text of another
corpus (the docstrings of third-party packages, `bench/build_corpora.py`) and on the built-in corpus's evaluation
part; training and calibration on the built-in corpus's calibration part. Each row runs in a process of its own:
its peak resident memory is that process's (model load, quantization and scoring), beside the peak after loading.

Equal steps: `qt.Step("qat", iters=N, batch_size=B)` gives every weight N Adam updates of B sequences (block by
block, against the float block's output, from GPTAQ's solution or from min-max RTN; every 5th calibration batch
judges whether the trained state or the start is kept: "trained kept" counts the tensors that kept the trained
one). torchao's row gets N Adam updates of the whole model, B sequences each, next-token cross-entropy, drawn from
all the calibration sequences, with the same cosine decay; its linear weights alone train (embedding, norms and the
tied head stay float, as on our side). "training tokens" = N x B x sequence length: per block for ours, through the
whole model for torchao's. SignRound from GPTAQ runs N signed steps of B sequences per block.

torchao (its version in the JSON rows): `QATConfig(weight_config=IntxFakeQuantizeConfig(torch.int<b>, group_size=G,
is_symmetric=False), step="prepare")` through `quantize_`, then the fake quantizer's output written into each weight
and `QATConfig(step="convert")`. "integer zero point" is that config's default (`ZeroPointDomain.INT`): in 0.18 its
asymmetric per-group qparams are the tinygemm ones (a float zero point) cast to int32, so the grid is not min-max's;
"float zero point" is `zero_point_domain=FLOAT, zero_point_precision=float32` (tinygemm's scheme: a richer format
than our integer zero point). `QATConfig(IntxWeightOnlyConfig(..., mapping_type=ASYMMETRIC))` (the route whose
convert quantizes for real) is refused by torchao for asymmetric mappings; its message is in each row's `peer`.
A group size that does not divide a layer's in_features (576 in groups of 128) is refused by torchao's fake quantizer
(ours pads the last group): such rows say so.
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one of our rows, in a process of its own
    ap.add_argument("--calib", type=int, default=40)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help=f"schemes (default: all of {ALL_SCHEMES})")
    ap.add_argument("--methods", nargs="*", default=None, help=f"rows (default: all of {METHODS})")
    ap.add_argument("--iters", nargs="+", type=int, default=[100], help="training budgets (learned rows)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per training step, both sides")
    ap.add_argument("--peer-python", default=None, help="python of a virtualenv with torchao")
    ap.add_argument("--peer-lr", type=float, default=2e-5, help="torchao's Adam learning rate")
    ap.add_argument("--other-corpus", default=str(OTHER), help="held-out text file (bench/build_corpora.py)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (smoke runs)")
    a = ap.parse_args()
    if a.row:
        return row_main(a.row)
    for m in a.methods or []:
        if m not in METHODS:
            ap.error(f"--methods: unknown method {m!r}; known: {METHODS}")
    for s in a.only or []:
        if s not in ALL_SCHEMES:
            ap.error(f"--only: unknown scheme {s!r}; known: {ALL_SCHEMES}")
    other = pathlib.Path(a.other_corpus)
    if not other.is_file():
        ap.error(f"--other-corpus: {other} not found (python bench/build_corpora.py writes it)")
    load_before = os.getloadavg()
    torch.set_num_threads(a.threads)
    from bridge.app import corpus, evaluate, models

    model, tok = models.load_with_tokenizer()
    model = truncate(model.eval(), a.layers)
    seqs = lambda text, n: corpus.token_sequences(text, tok, seq_len=a.seq_len, max_sequences=n)  # noqa: E731
    evs = [seqs(corpus.load_text(other, part="eval"), a.eval), seqs(corpus.load_text("builtin", part="eval"), a.eval)]
    cal = seqs(corpus.load_text("builtin", part="calibration"), a.calib)
    with torch.no_grad():
        fp = [evaluate.perplexity(model, ev).perplexity for ev in evs]
    with tempfile.TemporaryDirectory() as tmp:
        files = {"calib": os.path.join(tmp, "calib.pt"), "model": os.path.join(tmp, "model"),
                 "eval": [os.path.join(tmp, "eval_other.pt"), os.path.join(tmp, "eval_builtin.pt")]}
        torch.save(cal.clone(), files["calib"])
        for ev, path in zip(evs, files["eval"]):
            torch.save(ev.clone(), path)
        if a.peer_python and any(m in PEER for m in a.methods or METHODS):
            save_float(model, tok, files["model"])
        del model
        rows, skipped = measure(files, fp, a)
    path = RESULTS / "qat.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    rows = merge(old.get("rows", []), rows)
    commands = old.get("commands", []) + [" ".join(["python", *sys.argv])]
    info, load_after = machine(), os.getloadavg()
    text = "\n\n".join(f"## {s}\n\n{table(rows, s)}" for s in ALL_SCHEMES if any(r["scheme"] == s for r in rows))
    if any(r["method"] in LEARNED for r in rows):
        text += "\n\n## Token-budget curve (ppl ratio on the third-party docstrings)\n\n" + curve(rows)
    if skipped:
        text += "\n\nleft out of this run: " + "; ".join(f"{BASES[m]}: {w}" for m, w in skipped.items())
    text += (f"\n\nfloat perplexity {fp[0]:.3f} (third-party docstrings, {evs[0].numel()} tokens), {fp[1]:.3f} "
             f"(built-in eval, {evs[1].numel()} tokens); calibration {a.calib}x{a.seq_len} tokens"
             + (f"; the first {a.layers} decoder layers only (a smoke run)" if a.layers else "")
             + f"; {a.threads} threads; {info['cpu']}, torch {info['torch']}, python {info['python']}; load average "
             f"{load_before[0]:.1f} before, {load_after[0]:.1f} after this run (1 min; each row's at its end in the "
             "JSON; the machine's 2 cores are shared with other sessions).\n\ncommands (runs merged, newest last):\n\n"
             + "\n".join(f"    {c}" for c in commands))
    write("qat", rows, text, {"fp_ppl": fp, "corpora": [str(other.name), "builtin eval"], "skipped": skipped,
                              "load_before": load_before, "load_after": load_after, "commands": commands})
    DOCS.write_text(PREFACE + "\n" + text + "\n")


if __name__ == "__main__":
    main()
