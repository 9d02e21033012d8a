"""Learned rounding on the default model (SmolLM2-135M-Instruct), side by side with intel's auto-round (issue 33):
perplexity ratio quantized / float on 16x512 tokens of the built-in corpus's evaluation part, calibrated on 40x512
tokens of its calibration part, and the seconds of the quantization call, all run in this script on the same
tokens and threads, one after the other. Widths: W4 g128, W3 g64, W2 g64, unsigned asymmetric with an integer zero
point. Rows: RTN, GPTQ, AWQ, SignRound (from min-max ranges, from a clipping search: init="mse", and from GPTQ's solution:
init="gptq"), AWQ->SignRound, GPTAQ, each also followed by a rank-32 low-rank
correction, and auto-round (SignRound's reference implementation) with the same scheme, tokens, iterations, batch
size and learning rate.

auto-round runs in its own virtualenv (``make bench-signround-peer``):
``--peer-python /tmp/qtransform-autoround/bin/python``.

    .venv/bin/python bench/bench_signround.py [--peer-python PY] [--only uint2-asym-g64 ...] [--methods rtn gptq ...]
        [--iters 4] [--batch-size 1] [--lr 0.25]

A row whose step is not registered on this checkout (or refuses the options) is printed as "not available on this
main" and left out. Rows of earlier runs that this run did not repeat are kept (bench/results/signround.json).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import qtransform as qt
from qtransform.algorithms.signround import GPTQ_INITS, default_lr

from bench_gptq import arguments, ours, setup
from common import RESULTS, machine, markdown, write

HERE = pathlib.Path(__file__).parent
#: name -> (bits, group size); uint, asymmetric, integer zero point, groups along in_features.
SCHEMES = {"uint4-asym-g128": (4, 128), "uint3-asym-g64": (3, 64), "uint2-asym-g64": (2, 64)}
BASES = {"rtn": "RTN", "gptq": "GPTQ", "awq": "AWQ", "signround": "SignRound",
         "signround_mse": "SignRound, init mse", "signround_gptq": "SignRound, init gptq",
         "signround_gptaq": "SignRound, init gptaq", "signround_clip": "SignRound, clipping only",
         "awq_signround": "AWQ -> SignRound", "gptaq": "GPTAQ"}
LOWRANK = "+lowrank32"
#: every row in table order: each of ours, then each + the rank-32 correction, then the peer.
METHODS = [*BASES, *(b + LOWRANK for b in BASES), "autoround"]
#: Why these iterations (measured on this machine).
CHOICE = ("Iterations and batch: auto-round's defaults (200 iterations, batch 8 of 2048 tokens) take hours on this "
          "CPU for each width. Measured with auto-round 0.16.1 on SmolLM2 at seqlen 512, 40 samples, float32, 2 "
          "threads: per decoder block a fixed cost of 80 block forwards (the float outputs and the next inputs of the "
          "40 samples) and about 2.6 s per tuning iteration of batch 1 at load 6-8. Runs so far: W4 g128 at 4 "
          "iterations of batch 1 (auto-round x1.82, worse than RTN x1.28: each signed step moves every offset by up to "
          "lr = 1/4, and the kept 'best' iterate is judged on one sample's loss); W2 g64 at 8 iterations of batch 4, "
          "lr 1/8, both sides in one run (load 4-8). Both sides get the same iterations, batch and lr; auto-round runs "
          "in float32 (amp off: ours runs in float32; its CPU default casts to bfloat16) and its torch.compile follows "
          "its own rule (off below 10 iterations). Rerun with --iters 200 --batch-size 8 where hours are available "
          "(a GPU).")


def spec_of(name: str) -> qt.QuantSpec:
    bits, group = SCHEMES[name]
    return qt.QuantSpec(format=f"uint{bits}", granularity=qt.PerGroup(group), symmetric=False, pad=True)


def steps_of(method: str, *, iters: int, batch_size: int, lr: float, amp: bool = False) -> list[qt.Step]:
    """The recipe steps of one of our rows (``METHODS`` but ``autoround``)."""
    base, low = (method[:-len(LOWRANK)], True) if method.endswith(LOWRANK) else (method, False)
    if base not in BASES:
        raise ValueError(f"--methods: unknown method {method!r}; known: {METHODS}")
    learned = dict(iters=iters, batch_size=batch_size, lr=lr, **({"amp": True} if amp else {}))
    signround = qt.Step("signround", **learned)
    steps = {"rtn": [], "gptq": [qt.Step("gptq")], "awq": [qt.Step("awq")], "signround": [signround],
             "signround_mse": [qt.Step("signround", **learned, init="mse")],
             "signround_clip": [qt.Step("signround", **learned, offsets=False)],  # learned weight clipping alone
             # from GPTQ's or GPTAQ's start the step's own lr: 1 / (10 iters)
             **{f"signround_{i}": [qt.Step("signround", **{k: v for k, v in learned.items() if k != "lr"}, init=i)]
                for i in GPTQ_INITS},
             "awq_signround": [qt.Step("awq", clip=False), signround],
             "gptaq": [qt.Step("gptq", gptaq=True)]}[base]
    return steps + [qt.Step("lowrank", rank=32)] if low else steps


def unavailable(steps: list[qt.Step]) -> str | None:
    """Why these steps cannot run on this checkout (a step not registered, or options it refuses), else None."""
    for step in steps:
        if step.name not in qt.ALGORITHMS:
            return f"step {step.name!r} is not registered"
        try:
            qt.ALGORITHMS[step.name].check(dict(step.options))
        except (TypeError, ValueError) as e:
            return f"step {step.name!r} refuses {dict(step.options)}: {e}"
    return None


def peer_command(python: str, files: tuple[str, str, str], scheme: str, *, iters: int, batch_size: int, lr: float,
                 threads: int, out: str, amp: bool = False) -> list[str]:
    """The command line of bench/peer_autoround.py for one scheme."""
    bits, group = SCHEMES[scheme]
    return [python, str(HERE / "peer_autoround.py"), "--model", files[2], "--tokens", files[0], "--eval", files[1],
            "--bits", str(bits), "--group-size", str(group), "--iters", str(iters), "--batch-size", str(batch_size),
            "--lr", repr(lr), "--threads", str(threads), "--out", out] + (["--amp"] if amp else [])


def peer(python: str, files, scheme: str, **kw) -> dict | None:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        done = subprocess.run(peer_command(python, files, scheme, out=out, **kw), capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            print(f"auto-round {scheme}: failed ({done.returncode}): {done.stderr.strip()[-600:]}", flush=True)
            return None
        return json.loads(pathlib.Path(out).read_text())


def measure(model, cal, ev, fp, *, schemes, methods, iters, batch_size, lr, threads=2, peer_python=None,
            files=None, amp=False) -> tuple[list[dict], dict[str, str]]:
    """One row per (scheme, method) that ran: ``{"scheme", "method", "ppl", "ratio", "seconds", "load"}``, and
    ``{method: why}`` for the methods that cannot run here (not registered, or no ``peer_python``)."""
    rows, skipped = [], {}
    for scheme in schemes:
        for method in methods:
            if method == "autoround":
                if peer_python is None:
                    skipped[method] = "no --peer-python"
                    continue
                other = peer(peer_python, files, scheme, iters=iters, batch_size=batch_size, lr=lr, threads=threads,
                             amp=amp)
                if other is None:
                    skipped[method] = "auto-round failed (see the log)"
                    continue
                ppl, seconds = other["ppl"], other["seconds"]
            else:
                steps = steps_of(method, iters=iters, batch_size=batch_size, lr=lr, amp=amp)
                why = unavailable(steps)
                if why is not None:
                    if method not in skipped:
                        print(f"{BASES.get(method, method)} ({method}): not available on this main ({why})", flush=True)
                    skipped[method] = why
                    continue
                r = ours(model, spec_of(scheme), cal, ev, fp, steps)
                ppl, seconds = r["ppl"], r["seconds"]
            row = {"scheme": scheme, "method": method, "ppl": round(ppl, 3), "ratio": round(ppl / fp, 4),
                   "seconds": round(seconds, 1), "load": round(os.getloadavg()[0], 1),
                   "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            if "signround" in method or method == "autoround":  # signround_mse too
                step_lr = lr if method == "autoround" else next(
                    s.options.get("lr", default_lr(iters, s.options.get("init", "minmax")))
                    for s in steps if s.name == "signround")
                row["settings"] = {"iters": iters, "batch_size": batch_size, "lr": step_lr,
                                   **({"amp": True} if amp else {})}
            if method == "autoround":
                row["peer"] = {k: other.get(k) for k in ("max_distinct_per_group", "layers_changed", "versions")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows, skipped


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` with the rows of ``old`` whose (scheme, method) it did not repeat, in table order."""
    key = {(r["scheme"], r["method"]): r for r in old}
    key.update({(r["scheme"], r["method"]): r for r in new})
    order = {m: i for i, m in enumerate(METHODS)}
    schemes = {s: i for i, s in enumerate(SCHEMES)}
    return sorted(key.values(), key=lambda r: (order.get(r["method"], len(order)), schemes.get(r["scheme"], 99)))


def label(method: str) -> str:
    if method == "autoround":
        return "auto-round (intel, same run)"
    return BASES[method[:-len(LOWRANK)]] + " + low-rank 32" if method.endswith(LOWRANK) else BASES[method]


def table(rows: list[dict], settings: dict | None = None) -> str:
    """Methods down, schemes across: ``x1.234, 56.7 s`` per cell, ``-`` where that pair has not run; a learned
    row run with other iterations/batch/lr than ``settings`` says so in its cell."""
    def cell(r):
        other = r.get("settings") not in (None, settings)
        return f"x{r['ratio']}, {r['seconds']} s" + (f" ({r['settings']['iters']} it, batch "
                                                     f"{r['settings']['batch_size']}, lr {r['settings']['lr']:g}"
                                                     + (", amp" if r['settings'].get("amp") else "") + ")"
                                                     if other else "")
    cells = {(r["scheme"], r["method"]): cell(r) for r in rows}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    return markdown(["method", *SCHEMES], [[label(m), *(cells.get((s, m), "-") for s in SCHEMES)] for m in methods])


def main() -> None:
    ap = arguments(SCHEMES)
    ap.add_argument("--methods", nargs="*", default=None, help=f"rows to run (default: all of {METHODS})")
    ap.add_argument("--iters", type=int, default=4, help="SignRound iterations per block, both sides")
    ap.add_argument("--batch-size", type=int, default=1, help="samples per SignRound iteration, both sides")
    ap.add_argument("--lr", type=float, default=None, help="signed-gradient step, both sides (default 1 / iters)")
    ap.add_argument("--amp", action="store_true", help="tuning in bfloat16, both sides (ours: amp=True; auto-round's "
                                                       "amp, its CPU default)")
    a = ap.parse_args()
    methods = a.methods or METHODS
    for m in methods:
        if m != "autoround":
            steps_of(m, iters=1, batch_size=1, lr=1.0)  # an unknown name fails before the model loads
    lr = a.lr if a.lr is not None else 1.0 / a.iters
    model, cal, ev, fp, files = setup(a)
    rows, skipped = measure(model, cal, ev, fp, schemes=a.only or list(SCHEMES), methods=methods, iters=a.iters,
                            batch_size=a.batch_size, lr=lr, threads=a.threads, peer_python=a.peer_python, files=files,
                            amp=a.amp)
    path = RESULTS / "signround.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    rows = merge(old.get("rows", []), rows)
    commands = old.get("commands", []) + [" ".join(["python", *sys.argv])]
    text = table(rows, {"iters": a.iters, "batch_size": a.batch_size, "lr": lr, **({"amp": True} if a.amp else {})})
    if skipped:
        text += "\n\nnot available on this main (left out): " + "; ".join(f"{label(m)}: {w}"
                                                                         for m, w in skipped.items())
    if any(r["method"] == "autoround" for r in rows):
        text += ("\n\nauto-round's model is scored as it leaves it in memory (weights fake-quantized in place); "
                 "bench/peer_autoround.py refuses a result unless every linear layer but the head holds at most "
                 "2^bits distinct values in each group.")
    info = machine()
    text += (f"\n\nfloat perplexity {fp:.3f} on {ev.numel()} tokens; calibration {a.calib}x{a.seq_len} tokens; "
             f"SignRound (both sides) {a.iters} iterations, batch {a.batch_size}, lr {lr:g}; {a.threads} threads; "
             f"{info['cpu']}, torch {info['torch']}; load average at the end of each row in the JSON "
             f"(this run ended at {os.getloadavg()[0]:.1f}; the machine's 2 cores are shared by other sessions)."
             f"\n\n{CHOICE}\n\ncommands (runs merged, newest last):\n\n" + "\n".join(f"    {c}" for c in commands))
    write("signround", rows, text, {"fp_ppl": fp, "iters": a.iters, "batch_size": a.batch_size, "lr": lr,
                                    "skipped": skipped, "commands": commands})


if __name__ == "__main__":
    main()
