"""W8A8 quality on the default model (SmolLM2-135M-Instruct): perplexity ratio quantized / float, calibrated
on 64x512 tokens of the built-in corpus's calibration part (standard-library docstrings), evaluated on
16x512 tokens of its evaluation part (other modules' docstrings) *and* of each ``--corpus`` file: text the
calibration never saw (``bench/build_corpora.py`` writes two: third-party packages' docstrings and
lm-evaluation-harness's task READMEs). Each ratio is to the float model on that same text. AMD Quark 0.13's
anchors (the issue's, on the built-in evaluation part; ~500 s a SmoothQuant run: not re-run here) are
printed beside ours; the searched α per layer goes to the JSON.

    .venv/bin/python bench/build_corpora.py
    .venv/bin/python bench/bench_w8a8_quality.py [--calib 64] [--eval 16] [--seq-len 512]
        [--corpus out/corpora/thirdparty_docstrings.txt out/corpora/task_readmes.txt] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import torch

import qtransform as qt

from common import markdown, merged, write

W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
A8 = qt.QuantSpec(format="int8")
QUARK = {"int8 static": "x2.62", "int8 static + SmoothQuant a=0.5": "x1.315",
         "int8 static + SmoothQuant a=1.0": "x1.079", "fp8 w8a8 static + fp8 KV cache": "x1.030"}
ROOT = Path(__file__).resolve().parents[1]
CORPORA = tuple(str(ROOT / "out" / "corpora" / f) for f in ("thirdparty_docstrings.txt", "task_readmes.txt"))


def schemes() -> dict[str, tuple[qt.Recipe, bool]]:
    """name -> (recipe, needs calibration)."""
    linear = {"type_rules": {"Linear": W8}, "exclude": ["lm_head*"]}
    out = {"int8 static": (qt.Recipe(**linear, input=A8), True)}
    for label, opts in (("a=0.5", dict(alpha=0.5)), ("a=1.0", dict(alpha=1.0)),
                        ("a=auto (score=calibration, default)", dict(alpha="auto")),
                        ("a=auto (score=heldout)", dict(alpha="auto", score="heldout"))):
        out[f"int8 static + SmoothQuant {label}"] = (
            qt.Recipe(**linear, input=A8, steps=[qt.Step("smoothquant", **opts)]), True)
    out["fp8 w8a8 static + fp8 KV cache"] = (qt.get_preset("fp8-w8a8-kv").recipe, True)
    kv = qt.get_preset("fp8-w8a8-kv").recipe  # the same, one k_scale/v_scale per key/value head
    out["fp8 w8a8 static + fp8 KV cache per head"] = (dataclasses.replace(
        kv, kv_cache=qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(1))), True)
    out["int8 dynamic per-token"] = (qt.get_preset("w8a8-int8-dynamic").recipe, False)
    return out


def _cell(row: dict, corpus: str) -> str:
    ratios = row.get("ratios") or {"builtin eval": row["ratio"]}  # a row of an earlier run: the built-in text only
    return f"x{ratios[corpus]}" if corpus in ratios else "-"


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--calib-batch", type=int, default=4)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--corpus", nargs="*", default=list(CORPORA), help="evaluation text files besides the built-in")
    ap.add_argument("--only", nargs="*", default=None, help="scheme names to run (default: all)")
    return ap.parse_args()


def main() -> None:
    import bridge
    from bridge import pipeline
    from bridge.app import corpus, evaluate, models

    a = _args()
    model, tok = models.load_with_tokenizer()
    model.eval()
    texts = {"builtin eval": corpus.load_text("builtin", part="eval")}
    texts.update({Path(p).stem: corpus.load_text(p) for p in a.corpus})
    evals = {k: corpus.token_sequences(t, tok, seq_len=a.seq_len, max_sequences=a.eval) for k, t in texts.items()}
    cal = list(corpus.token_sequences(corpus.load_text("builtin", part="calibration"), tok, seq_len=a.seq_len,
                                      max_sequences=a.calib).split(a.calib_batch))
    with torch.no_grad():
        fp = {k: evaluate.perplexity(model, ev).perplexity for k, ev in evals.items()}
    print("float", {k: round(v, 3) for k, v in fp.items()}, flush=True)
    rows, order = [], list(schemes())
    names = [n for n in (a.only or order) if n in order]
    for name in sorted(names, key=(a.only or order).index):  # in --only's order: the first ones matter most
        recipe, calibrated = schemes()[name]
        t = time.perf_counter()
        with torch.no_grad():
            r = pipeline.quantize_params(model, recipe, calibration=cal if calibrated else None)
            alphas = {k: v["smoothquant_alpha"] for k, v in r.info.items() if "smoothquant_alpha" in v}
            qm = bridge.to_module(model, r, kernel="dequant")
            seconds = time.perf_counter() - t
            del r
            ratios = {k: round(evaluate.perplexity(qm, ev).perplexity / fp[k], 4) for k, ev in evals.items()}
        rows.append({"scheme": name, "ratios": ratios, "ratio": ratios["builtin eval"], "quantize_s": round(seconds, 1),
                     "quark": QUARK.get(name, "-"), "alphas": alphas})
        print(name, ratios, round(seconds, 1), flush=True)
        del qm
        _write(rows, order, list(evals), fp, a)  # after each scheme: a long run stopped early keeps what it measured


def _write(rows, order, cols, fp, a) -> None:
    rows = merged("w8a8_quality", rows, order)
    table = markdown(["scheme"] + [f"ratio, {c}" for c in cols] + ["Quark 0.13 (builtin eval)", "quantize + calibrate, s"],
                     [[r["scheme"]] + [_cell(r, c) for c in cols] + [r["quark"], r["quantize_s"]] for r in rows])
    table += (f"\n\nfloat perplexity {', '.join(f'{k} {v:.3f}' for k, v in fp.items())} on {a.eval}x{a.seq_len} tokens "
              f"each; calibration {a.calib}x{a.seq_len} tokens of the built-in calibration part; "
              f"load average {os.getloadavg()[0]:.1f}. Rows without the other corpora come from an earlier run "
              "(40x512 calibration tokens, 16x512 evaluation tokens).")
    write("w8a8_quality", rows, table, {"fp_ppl": fp, "load_average": os.getloadavg()[0], "calib": a.calib,
                                        "eval": a.eval, "corpora": [Path(p).name for p in a.corpus]})


if __name__ == "__main__":
    main()
