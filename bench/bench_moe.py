"""Mixture-of-experts (issue 32): GPTQ per expert against round to nearest, the tokens each expert gets, and the
time and peak memory of quantizing a Qwen3-MoE-shaped block with 64 experts on this machine.

1. ``quality``: a random Qwen3-MoE (4 layers, hidden 256, 16 experts of 128, top 4) and a random Mixtral (4 layers,
   hidden 256, 8 experts of 256, top 2) quantized with int4 g32 by round to nearest and by GPTQ (the same spec,
   calibrated on 16x128 random tokens, each expert from the tokens routed to it; and with ``all_experts``), then
   each expert's layer output error measured on 8x128 *other* tokens, routed by the float model:
   ``||X_e (W_e - Q_e)^T||^2 / ||X_e W_e^T||^2`` for ``gate_up_proj`` and ``down_proj`` (down's input from the
   float gate_up). Reported per model and projection: the median over experts of GPTQ's error / RTN's (goal < 1),
   and the calibration tokens per expert (fewest, median, most).
2. ``block``: one Qwen3-30B-A3B-shaped layer (hidden 2048, 64 experts of 768, top 8; vocabulary cut to 2048) in
   bf16, GPTQ int4 g128 (``gptq4-g128``'s spec) on 8x512 tokens and RTN, each in its own process under
   ``/usr/bin/time -v``: wall seconds and peak RSS.

    .venv/bin/python bench/bench_moe.py [--quick]    (results: bench/results/moe.{json,md})

No MoE checkpoint can be downloaded here (no hub access), so no real model is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

import torch

from common import markdown, write

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent))


def _model(kind: str, *, layers: int, hidden: int, experts: int, inter: int, top: int, vocab: int, dtype):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
                                num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512),
                                head_dim=128 if hidden >= 1024 else hidden // 4, num_experts=experts, num_experts_per_tok=top,
                                max_position_embeddings=1024)
        return tf.Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    cfg = tf.MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                           num_experts_per_tok=top, max_position_embeddings=1024)
    return tf.MixtralForCausalLM(cfg).to(dtype).eval()


def _routed(model, ids):
    """``{experts path: [(X_e for gate_up, X_e for down) per expert]}`` of the float model on ``ids``."""
    from bridge.modules.experts import is_experts, routed_forward

    seen = {}
    for name, m in model.named_modules():
        if is_experts(m):
            seen[name] = [([], []) for _ in range(m.num_experts)]

            def forward(h, idx, w, _m=m, _s=seen[name]):
                def tap(proj, e, x):
                    _s[e][0 if proj != "down_proj" else 1].append(x.detach().float())
                return routed_forward(_m, h, idx, w, matrix=lambda n, e, dt, _m=_m: getattr(_m, n)[e].to(dt), tap=tap)
            m.forward = forward
    with torch.no_grad():
        model(ids)
    for name, m in model.named_modules():
        if name in seen:
            del m.forward
    return {k: [(torch.cat(a) if a else None, torch.cat(b) if b else None) for a, b in v] for k, v in seen.items()}


def _errors(model, qtree, routed) -> dict:
    import qtransform as qt

    out = {}
    for name, per in routed.items():
        for j, proj in enumerate(("gate_up_proj", "down_proj")):
            w = dict(model.named_parameters())[f"{name}.{proj}"].detach().float()
            q = qt.dequantize(qtree[f"{name}.{proj}"]).float()
            errs = []
            for e, xs in enumerate(per):
                x = xs[j]
                if x is None or not x.shape[0]:
                    errs.append(None)
                    continue
                ref = x @ w[e].T
                errs.append(float(((x @ (w[e] - q[e]).T) ** 2).sum() / (ref ** 2).sum()))
            out[f"{name}.{proj}"] = errs
    return out


def quality(quick: bool) -> list[dict]:
    import bridge
    import qtransform as qt

    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
    rtn = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"])
    gptq = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"], steps=["gptq"])
    rows = []
    shapes = {"qwen3_moe": dict(layers=4, hidden=256, experts=16, inter=128, top=4),
              "mixtral": dict(layers=4, hidden=256, experts=8, inter=256, top=2)}
    n_cal, n_eval = (4, 2) if quick else (16, 8)
    for kind, shape in shapes.items():
        model = _model(kind, vocab=1024, dtype=torch.float32, **shape)
        g = torch.Generator().manual_seed(1)
        cal = [torch.randint(0, 1024, (1, 128), generator=g) for _ in range(n_cal)]
        ev = torch.randint(0, 1024, (n_eval, 128), generator=g)
        routed = _routed(model, ev)
        res = {"rtn": bridge.quantize_params(model, rtn)}
        t = time.perf_counter()
        res["gptq"] = bridge.quantize_params(model, gptq, calibration=cal)
        seconds = time.perf_counter() - t
        res["gptq_all"] = bridge.quantize_params(model, gptq, calibration=cal, all_experts=True)
        errs = {k: _errors(model, r.qtree, routed) for k, r in res.items()}
        for path in errs["rtn"]:
            tokens = res["gptq"].info[path]["experts"]["tokens"]
            row = {"model": kind, "tensor": path, "experts": len(tokens),
                   "tokens_min": min(tokens), "tokens_median": statistics.median(tokens), "tokens_max": max(tokens),
                   "fell_back": res["gptq"].info[path]["experts"]["fallback"].get("rtn", []), "gptq_seconds": seconds}
            for k in ("gptq", "gptq_all"):
                ratios = [a / b for a, b in zip(errs[k][path], errs["rtn"][path]) if a is not None and b]
                row[f"{k}_over_rtn_median"] = statistics.median(ratios)
                row[f"{k}_over_rtn_worst"] = max(ratios)
            row["rtn_error_median"] = statistics.median([e for e in errs["rtn"][path] if e is not None])
            rows.append(row)
    return rows


_WORKER = r'''
import sys, time, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/bench")
import bench_moe, bridge, qtransform as qt
method, quick = sys.argv[2], sys.argv[3] == "1"
model = bench_moe._model("qwen3_moe", layers=1, hidden=2048, experts=64, inter=768, top=8, vocab=2048, dtype=torch.bfloat16)
spec = qt.get_preset("gptq4-g128").spec
recipe = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"], steps=["gptq"] if method == "gptq" else [])
g = torch.Generator().manual_seed(1)
cal = [torch.randint(0, 2048, (1, 128 if quick else 512), generator=g) for _ in range(2 if quick else 8)]
t = time.perf_counter()
r = bridge.quantize_params(model, recipe, calibration=cal if method == "gptq" else None)
print("SECONDS", time.perf_counter() - t)
'''


def block(quick: bool) -> list[dict]:
    rows = []
    for method in ("rtn", "gptq"):
        cmd = ["/usr/bin/time", "-v", sys.executable, "-c", _WORKER, str(HERE.parent), method, "1" if quick else "0"]
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        wall = time.perf_counter() - t
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
        rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
        seconds = float(re.search(r"SECONDS ([\d.]+)", p.stdout).group(1))
        rows.append({"method": method, "quantize_seconds": round(seconds, 1), "process_seconds": round(wall, 1),
                     "peak_rss_gb": round(rss / 2**20, 2), "load": os.getloadavg()[0]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    q = quality(a.quick)
    b = block(a.quick)
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    t1 = markdown(["model", "tensor", "experts", "tokens min/median/max", "fell back", "GPTQ/RTN median", "worst",
                   "all-experts GPTQ/RTN median"],
                  [[r["model"], r["tensor"].replace("model.layers.", "L"), r["experts"],
                    f"{r['tokens_min']}/{r['tokens_median']:g}/{r['tokens_max']}", r["fell_back"] or "-",
                    fmt(r["gptq_over_rtn_median"]), fmt(r["gptq_over_rtn_worst"]), fmt(r["gptq_all_over_rtn_median"])]
                   for r in q])
    t2 = markdown(["Qwen3-30B-A3B-shaped layer (64 experts), bf16", "quantize s", "process s", "peak RSS GB", "load"],
                  [[r["method"], r["quantize_seconds"], r["process_seconds"], r["peak_rss_gb"], f"{r['load']:.1f}"]
                   for r in b])
    write("moe_quick" if a.quick else "moe", q + b, t1 + "\n\n" + t2, {"quality": q, "block": b})
    print(json.dumps({"ok": True}))


if __name__ == "__main__":
    main()
