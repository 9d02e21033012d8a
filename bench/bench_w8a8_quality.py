"""W8A8 quality on the default model (SmolLM2-135M-Instruct): perplexity ratio quantized / float on
16x512 tokens of the built-in corpus's evaluation part, calibrated on 40x512 tokens of its
calibration part (other docstrings), the setup of the issue's AMD Quark 0.13 anchors, which are
printed beside ours (Quark's SmoothQuant run took ~500 s on this kind of machine; not re-run here).

    .venv/bin/python bench/bench_w8a8_quality.py [--calib 40] [--eval 16] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import qtransform as qt
import bridge
from bridge.app import corpus, evaluate, models

from common import RESULTS, markdown, write

W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
A8 = qt.QuantSpec(format="int8")
QUARK = {"int8 static": "x2.62", "int8 static + SmoothQuant a=0.5": "x1.315",
         "int8 static + SmoothQuant a=1.0": "x1.079", "fp8 w8a8 static + fp8 KV cache": "x1.030"}


def schemes() -> dict[str, tuple[qt.Recipe, bool]]:
    """name -> (recipe, needs calibration)."""
    linear = {"type_rules": {"Linear": W8}, "exclude": ["lm_head*"]}
    out = {"int8 static": (qt.Recipe(**linear, input=A8), True)}
    for alpha in (0.5, 1.0, "auto"):
        label = f"int8 static + SmoothQuant a={alpha}"
        out[label] = (qt.Recipe(**linear, input=A8, steps=[qt.Step("smoothquant", alpha=alpha)]), True)
    out["fp8 w8a8 static + fp8 KV cache"] = (qt.get_preset("fp8-w8a8-kv").recipe, True)
    out["int8 dynamic per-token"] = (qt.get_preset("w8a8-int8-dynamic").recipe, False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", type=int, default=40)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--only", nargs="*", default=None, help="scheme names to run (default: all)")
    a = ap.parse_args()
    model, tok = models.load()
    model.eval()
    ev = corpus.token_sequences(corpus.load_text("builtin", part="eval"), tok, seq_len=a.seq_len,
                                max_sequences=a.eval)
    cal = list(corpus.token_sequences(corpus.load_text("builtin", part="calibration"), tok, seq_len=a.seq_len,
                                      max_sequences=a.calib).split(4))
    with torch.no_grad():
        fp = evaluate.perplexity(model, ev).perplexity
    rows = []
    for name, (recipe, calibrated) in schemes().items():
        if a.only and name not in a.only:
            continue
        t = time.perf_counter()
        with torch.no_grad():
            qm = bridge.quantize(model, recipe, calibration=cal if calibrated else None, kernel="dequant")
        seconds = time.perf_counter() - t
        with torch.no_grad():
            ppl = evaluate.perplexity(qm, ev).perplexity
        rows.append({"scheme": name, "ppl": round(ppl, 3), "ratio": round(ppl / fp, 4),
                     "quantize_s": round(seconds, 1), "quark": QUARK.get(name, "-")})
        print(rows[-1], flush=True)
        del qm
    rows = merged(rows)
    table = markdown(["scheme", "perplexity", "ratio (ours)", "ratio (Quark 0.13)", "quantize + calibrate, s"],
                     [[r["scheme"], r["ppl"], f"x{r['ratio']}", r["quark"], r["quantize_s"]] for r in rows])
    table += (f"\n\nfloat perplexity {fp:.3f} on {ev.numel()} tokens; calibration {a.calib}x{a.seq_len} tokens; "
              f"load average {os.getloadavg()[0]:.1f}")
    write("w8a8_quality", rows, table, {"fp_ppl": fp, "load_average": os.getloadavg()[0]})


def merged(rows: list[dict]) -> list[dict]:
    """``rows`` with the schemes of an earlier run (``--only``) that this run did not repeat, in scheme order."""
    path = RESULTS / "w8a8_quality.json"
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    new = {r["scheme"]: r for r in rows}
    names = [n for n in schemes() if n in new or any(r["scheme"] == n for r in old)]
    return [new.get(n) or next(r for r in old if r["scheme"] == n) for n in names]


if __name__ == "__main__":
    main()
