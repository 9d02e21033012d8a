"""W8A8 quality on the default model (SmolLM2-135M-Instruct): perplexity ratio quantized / float on
16x512 tokens of the built-in corpus's evaluation part, calibrated on 40x512 tokens of its
calibration part (other docstrings), the setup of the issue's AMD Quark 0.13 anchors, which are
printed beside ours (Quark's SmoothQuant run took ~500 s on this kind of machine; not re-run here).

    .venv/bin/python bench/bench_w8a8_quality.py [--calib 40] [--eval 16] [--seq-len 512]
"""

from __future__ import annotations

import dataclasses
import os

import qtransform as qt

from common import markdown, merged, quality_args, quality_runs, write

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
    kv = qt.get_preset("fp8-w8a8-kv").recipe  # the same, one k_scale/v_scale per key/value head
    out["fp8 w8a8 static + fp8 KV cache per head"] = (dataclasses.replace(
        kv, kv_cache=qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(1))), True)
    out["int8 dynamic per-token"] = (qt.get_preset("w8a8-int8-dynamic").recipe, False)
    return out


def main() -> None:
    a = quality_args(calib=40)
    fp, tokens, runs = quality_runs(schemes(), a)
    rows = [{"scheme": name, "ppl": round(ppl, 3), "ratio": round(ppl / fp, 4), "quantize_s": round(seconds, 1),
             "quark": QUARK.get(name, "-")} for name, ppl, seconds in runs]
    rows = merged("w8a8_quality", rows, list(schemes()))
    table = markdown(["scheme", "perplexity", "ratio (ours)", "ratio (Quark 0.13)", "quantize + calibrate, s"],
                     [[r["scheme"], r["ppl"], f"x{r['ratio']}", r["quark"], r["quantize_s"]] for r in rows])
    table += (f"\n\nfloat perplexity {fp:.3f} on {tokens} tokens; calibration {a.calib}x{a.seq_len} tokens; "
              f"load average {os.getloadavg()[0]:.1f}")
    write("w8a8_quality", rows, table, {"fp_ppl": fp, "load_average": os.getloadavg()[0]})


if __name__ == "__main__":
    main()
