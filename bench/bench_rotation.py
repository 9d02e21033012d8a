"""Rotations on the default model (SmolLM2-135M-Instruct): perplexity ratio quantized / float with
int4 weights (symmetric, per output channel) and per-token dynamic int8 or int4 activations, without
and with rotations, weights by RTN or GPTQ: QuaRot (``rotate``: norms fused, residual stream by a
randomised Hadamard of order 576 = 16 x 36, heads by a Hadamard of order 64, online Hadamard of
order 1536 before each down projection) and SpinQuant (``spinquant``: R1 and R2 learned from those
on the calibration data, 40 Cayley SGD iterations of one 512-token sequence each). 16x512 evaluation
tokens of the built-in corpus, GPTQ and SpinQuant calibrated on 16x512 others. The issue's anchors
(AMD Quark 0.13 and llm-compressor 0.14, same setup) are printed beside ours; not re-run here.

    .venv/bin/python bench/bench_rotation.py [--calib 16] [--eval 16] [--only NAME ...]
"""

from __future__ import annotations

import os

import qtransform as qt

from common import markdown, merged, quality_args, quality_runs, write

W4 = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
ACTS = {"W4A8": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True),
        "W4A4": qt.QuantSpec(format="int4", granularity=qt.PerChannel(0), dynamic=True)}
PEERS = {"W4A8 RTN": "x2.09 (no rotation)", "W4A8 rotate + RTN": "Quark x4.74, llmc QuIP x1.91",
         "W4A8 spinquant + RTN": "llmc SpinQuant-style (not learned) x4.27",
         "W4A4 RTN": "x397 (no rotation)", "W4A4 rotate + RTN": "Quark x119, llmc QuIP x3.07",
         "W4A4 spinquant + RTN": "llmc SpinQuant-style (not learned) x115"}
SPINQUANT = qt.Step("spinquant", iters=40)


def rotated_unquantized(model, _):
    """SmolLM2 rotated by the rotate step (R1, R2, online R3 and R4), nothing quantized."""
    import bridge

    recipe = qt.Recipe(type_rules={"Linear": W4}, exclude=["lm_head*"], steps=[qt.Step("rotate", r3=True)])
    params = bridge.extract(model)
    fit = qt.run_steps(params, bridge.plan(model, recipe))
    return bridge.to_module(model, bridge.Quantized(params, qt.apply_fit(params, fit), online=fit.online))


def schemes() -> dict:
    out = {"rotated (R1-R4), unquantized": (rotated_unquantized, False)}
    for name, act in ACTS.items():
        for steps in (["rtn"], ["rotate", "rtn"], [SPINQUANT, "rtn"], ["gptq"], ["rotate", "gptq"], [SPINQUANT, "gptq"]):
            names = [s if isinstance(s, str) else s.name for s in steps]
            label = f"{name} {' + '.join(s.upper() if s in ('rtn', 'gptq') else s for s in names)}"
            out[label] = (qt.Recipe(type_rules={"Linear": W4}, exclude=["lm_head*"], input=act, steps=steps),
                          "gptq" in names or "spinquant" in names)
    return out


def main() -> None:
    a = quality_args(calib=16, batch=1)
    fp, tokens, runs = quality_runs(schemes(), a)
    rows = [{"scheme": name, "ratio": round(ppl / fp, 3), "quantize_s": round(seconds, 1), "peers": PEERS.get(name, "-")}
            for name, ppl, seconds in runs]
    rows = merged("rotation", rows, list(schemes()))
    table = markdown(["scheme", "ratio (ours)", "peers (issue anchors)", "quantize, s"],
                     [[r["scheme"], f"x{r['ratio']}", r["peers"], r["quantize_s"]] for r in rows])
    table += (f"\n\nfloat perplexity {fp:.3f} on {tokens} tokens; GPTQ and SpinQuant calibration {a.calib}x{a.seq_len} "
              f"tokens; "
              f"load average {os.getloadavg()[0]:.1f}")
    write("rotation", rows, table, {"fp_ppl": fp, "load_average": os.getloadavg()[0]})


if __name__ == "__main__":
    main()
