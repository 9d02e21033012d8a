"""Mixture-of-experts (issue 32): GPTQ per expert against round to nearest, the tokens each expert gets, and the
time and peak memory of quantizing a Qwen3-MoE-shaped block with 64 experts on this machine.

1. ``quality``: a random Qwen3-MoE (4 layers, hidden 256, 16 experts of 128, top 4) and a random Mixtral (4 layers,
   hidden 256, 8 experts of 256, top 2) quantized with int4 g32 by round to nearest and by GPTQ (the same spec,
   calibrated on 16x128 random tokens, each expert from the tokens routed to it; and with ``all_experts``), then
   each expert's layer output error measured on 8x128 *other* tokens, routed by the float model:
   ``||X_e (W_e - Q_e)^T||^2 / ||X_e W_e^T||^2`` for ``gate_up_proj`` and ``down_proj`` (down's input from the
   float gate_up). Reported per model and projection: the median over experts of GPTQ's error / RTN's (goal < 1),
   and the calibration tokens per expert (fewest, median, most). Ours also with ``init="minmax"`` (the GPTQ
   textbook ranges, llm-compressor's).
   With ``--peer-python`` (``make bench-gptq-peer``): llm-compressor's GPTQ (``bench/peer_llmcompressor_moe.py``)
   on the same weights (``save_pretrained``; its float weights checked equal to ours, stacked back gate rows then
   up) and tokens, int4 symmetric g32 (the same grid: ``amax / 7.5``, codes -8..7), routers and ``lm_head`` float,
   once routed (``moe_calibrate_all_experts=False``) and once all-experts (its default), its fake-quantized expert
   weights measured the same way: the median over experts of ours / its, and each method's quantize seconds
   (same threads, one after the other, load average at each start). Options that differ: ours ``init="clip"``
   (clipping searched) against its min/max ranges (hence the minmax rows), ours ``expert_min_tokens=8`` (an
   expert with fewer routed tokens gets RTN; llm-compressor has no such fallback); damping 0.01, block 128, static act-order
   on both.
2. ``block``: one Qwen3-30B-A3B-shaped layer (hidden 2048, 64 experts of 768, top 8; vocabulary cut to 2048) in
   bf16, GPTQ int4 g128 (``gptq4-g128``'s spec) on 8x512 tokens and RTN, each in its own process under
   ``/usr/bin/time -v``: wall seconds and peak RSS.

    .venv/bin/python bench/bench_moe.py [--quick] [--peer-python /tmp/qtransform-llmc/bin/python] [--no-block]
    (results: bench/results/moe.{json,md}; moe_quick with --quick)

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
import tempfile
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
    """:func:`errors_of` of our quantized tree (each experts weight dequantized)."""
    import qtransform as qt

    return errors_of(model, {f"{n}.{p}": qt.dequantize(qtree[f"{n}.{p}"]) for n in routed for p in PROJS}, routed)


PROJS = ("gate_up_proj", "down_proj")


def errors_of(model, weights: dict, routed) -> dict:
    """``{experts path.proj: [error of expert e, or None where no held-out token reached it]}`` of the stacked
    ``(E, out, in)`` weights ``weights[path.proj]`` against the model's float ones, on the routed inputs:
    ``||X_e (W_e - Q_e)^T||^2 / ||X_e W_e^T||^2``."""
    params = dict(model.named_parameters())
    out = {}
    for name, per in routed.items():
        for j, proj in enumerate(PROJS):
            w = params[f"{name}.{proj}"].detach().float()
            q = weights[f"{name}.{proj}"].float()
            if q.shape != w.shape:
                raise ValueError(f"{name}.{proj}: quantized shape {tuple(q.shape)} != float {tuple(w.shape)}")
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


def median_ratio(a: list, b: list) -> tuple[float, float]:
    """(median, max) over experts of ``a[e] / b[e]``, the experts where both are measured and ``b[e] > 0``."""
    ratios = [x / y for x, y in zip(a, b) if x is not None and y]
    if not ratios:
        raise ValueError("no expert has both errors measured")
    return statistics.median(ratios), max(ratios)


SHAPES = {"qwen3_moe": dict(layers=4, hidden=256, experts=16, inter=128, top=4),
          "mixtral": dict(layers=4, hidden=256, experts=8, inter=256, top=2)}


def quality(quick: bool, peer_python: str | None = None, threads: int = 2) -> list[dict]:
    n_cal, n_eval = (4, 2) if quick else (16, 8)
    rows = []
    for kind, shape in SHAPES.items():
        rows += measure(kind, shape, n_cal=n_cal, n_eval=n_eval, peer_python=peer_python, threads=threads)
    return rows


def measure(kind: str, shape: dict, *, n_cal: int, n_eval: int, peer_python: str | None = None, threads: int = 2,
            vocab: int = 1024, seq: int = 128) -> list[dict]:
    """One random model of ``kind``/``shape``: RTN, GPTQ and all-experts GPTQ (ours), and llm-compressor's GPTQ
    routed and all-experts where ``peer_python`` is given; one row per experts weight."""
    import bridge
    import qtransform as qt

    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
    rtn = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"])
    gptq = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"], steps=["gptq"])
    model = _model(kind, vocab=vocab, dtype=torch.float32, **shape)
    g = torch.Generator().manual_seed(1)
    cal = [torch.randint(0, vocab, (1, seq), generator=g) for _ in range(n_cal)]
    ev = torch.randint(0, vocab, (n_eval, seq), generator=g)
    routed = _routed(model, ev)
    res, seconds, load = {}, {}, {}
    minmax = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"], steps=[qt.Step("gptq", init="minmax")])
    for key, recipe, kw in (("rtn", rtn, {}), ("gptq", gptq, dict(calibration=cal)),
                            ("gptq_all", gptq, dict(calibration=cal, all_experts=True)),
                            ("gptq_minmax", minmax, dict(calibration=cal)),
                            ("gptq_minmax_all", minmax, dict(calibration=cal, all_experts=True))):
        load[key] = os.getloadavg()[0]
        t = time.perf_counter()
        res[key] = bridge.quantize_params(model, recipe, **kw)
        seconds[key] = time.perf_counter() - t
    errs = {k: _errors(model, r.qtree, routed) for k, r in res.items()}
    peer = {}
    if peer_python:
        for key, all_experts in (("llmc", False), ("llmc_all", True)):
            load[key] = os.getloadavg()[0]
            out = run_peer(peer_python, model, torch.cat(cal), threads=threads, all_experts=all_experts)
            if "error" in out:
                peer[key] = out
                continue
            errs[key] = errors_of(model, out.pop("weights"), routed)
            seconds[key] = out["seconds"]
            peer[key] = out
    rows = []
    for path in errs["rtn"]:
        tokens = res["gptq"].info[path]["experts"]["tokens"]
        row = {"model": kind, "tensor": path, "experts": len(tokens),
               "tokens_min": min(tokens), "tokens_median": statistics.median(tokens), "tokens_max": max(tokens),
               "fell_back": res["gptq"].info[path]["experts"]["fallback"].get("rtn", []),
               "gptq_seconds": seconds["gptq"], "seconds": dict(seconds), "load": dict(load), "threads": threads}
        for k in [k for k in errs if k != "rtn"]:
            row[f"{k}_over_rtn_median"], row[f"{k}_over_rtn_worst"] = median_ratio(errs[k][path], errs["rtn"][path])
        for k in errs:
            row[f"{k}_error_median"] = statistics.median([e for e in errs[k][path] if e is not None])
        for mine, theirs in (("gptq", "llmc"), ("gptq_all", "llmc_all"), ("gptq", "llmc_all"),
                             ("gptq_minmax", "llmc"), ("gptq_minmax_all", "llmc_all")):
            if theirs in errs:
                row[f"{mine}_over_{theirs}_median"], row[f"{mine}_over_{theirs}_worst"] = median_ratio(
                    errs[mine][path], errs[theirs][path])
        if peer:
            row["peer"] = {k: {n: v for n, v in p.items()} for k, p in peer.items()}
        rows.append(row)
    return rows


def run_peer(python: str, model, tokens: torch.Tensor, *, threads: int, all_experts: bool) -> dict:
    """llm-compressor's GPTQ (``peer_llmcompressor_moe.py`` under ``python``) on ``model`` saved with
    ``save_pretrained`` (per-expert keys) and ``tokens`` ``(n, seq)``: ``{"seconds", "versions", "weights":
    {experts path.proj: (E, out, in)}, "grid_error", "grid_max"}``, or ``{"error": its stderr's tail}``. Refuses
    (ValueError) when the float weights it loaded are not ours in the same stacked order."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(os.path.join(d, "model"))
        torch.save(tokens.clone(), os.path.join(d, "calib.pt"))
        out = os.path.join(d, "result.pt")
        cmd = [python, str(HERE / "peer_llmcompressor_moe.py"), "--model", os.path.join(d, "model"), "--tokens",
               os.path.join(d, "calib.pt"), "--threads", str(threads), "--out", out] + (["--all-experts"] * all_experts)
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode or not os.path.exists(out):
            print(f"llm-compressor (all_experts={all_experts}) failed ({done.returncode}): {done.stderr[-2000:]}",
                  flush=True)
            return {"error": done.stderr[-2000:], "returncode": done.returncode}
        res = torch.load(out)
    params = dict(model.named_parameters())
    for k, w in res.pop("float").items():
        if not torch.equal(w, params[k].detach().float()):
            raise ValueError(f"{k}: llm-compressor's float expert weights {tuple(w.shape)} are not ours in our order")
    return res


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
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-python", default=None, help="python of a virtualenv with llmcompressor (make bench-gptq-peer)")
    ap.add_argument("--no-block", action="store_true", help="skip the 64-expert layer's time and memory")
    ap.add_argument("--only-block", action="store_true",
                    help="only the 64-expert layer's time and memory (results: bench/results/moe_block.{json,md})")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.only_block:
        b = block(a.quick)
        write("moe_block_quick" if a.quick else "moe_block", b, _block_table(b), {"block": b})
        return
    q = quality(a.quick, a.peer_python, a.threads)
    b = [] if a.no_block else block(a.quick)
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    t1 = markdown(["model", "tensor", "experts", "tokens min/median/max", "fell back", "GPTQ/RTN median", "worst",
                   "all-experts GPTQ/RTN median"],
                  [[r["model"], r["tensor"].replace("model.layers.", "L"), r["experts"],
                    f"{r['tokens_min']}/{r['tokens_median']:g}/{r['tokens_max']}", r["fell_back"] or "-",
                    fmt(r["gptq_over_rtn_median"]), fmt(r["gptq_over_rtn_worst"]), fmt(r["gptq_all_over_rtn_median"])]
                   for r in q])
    text = t1 + "\n\n" + _peer_tables(q, fmt)
    if not b:
        text += "\n\n(the 64-expert Qwen3-30B-A3B-shaped layer not measured: --no-block)"
    else:
        text += "\n\n" + _block_table(b)
    write("moe_quick" if a.quick else "moe", q + b, text, {"quality": q, "block": b})
    print(json.dumps({"ok": True}))


def _block_table(b: list[dict]) -> str:
    return markdown(["Qwen3-30B-A3B-shaped layer (64 experts), bf16", "quantize s", "process s", "peak RSS GB", "load"],
                    [[r["method"], r["quantize_seconds"], r["process_seconds"], r["peak_rss_gb"], f"{r['load']:.1f}"]
                     for r in b])


def _peer_tables(q: list[dict], fmt) -> str:
    """Ours against llm-compressor (per experts weight), and the quantize seconds of each method per model."""
    if not any("peer" in r for r in q):
        return "(no llm-compressor run: --peer-python not given)"
    failed = {(r["model"], k): p["error"].strip().splitlines()[-1] for r in q for k, p in r.get("peer", {}).items()
              if "error" in p}
    ok = [r for r in q if "gptq_over_llmc_median" in r or "gptq_all_over_llmc_all_median" in r]
    t = markdown(["model", "tensor", "ours GPTQ / llmc GPTQ (routed) median", "worst",
                  "ours all / llmc all-experts median", "worst", "ours GPTQ (routed) / llmc all-experts",
                  "ours minmax / llmc (routed)", "ours minmax all / llmc all", "llmc routed / RTN", "llmc all / RTN"],
                 [[r["model"], r["tensor"].replace("model.layers.", "L")] + [fmt(r.get(k, "-")) for k in (
                     "gptq_over_llmc_median", "gptq_over_llmc_worst", "gptq_all_over_llmc_all_median",
                     "gptq_all_over_llmc_all_worst", "gptq_over_llmc_all_median", "gptq_minmax_over_llmc_median",
                     "gptq_minmax_all_over_llmc_all_median", "llmc_over_rtn_median", "llmc_all_over_rtn_median")]
                  for r in ok])
    firsts = {r["model"]: r for r in q}.values()
    keys = ["rtn", "gptq", "gptq_all", "gptq_minmax", "gptq_minmax_all", "llmc", "llmc_all"]
    t += "\n\n" + markdown(["model (quantize seconds, load average at start)", "ours RTN", "ours GPTQ",
                             "ours GPTQ all-experts", "ours GPTQ minmax", "ours GPTQ minmax all-experts",
                             "llmc GPTQ routed", "llmc GPTQ all-experts"],
                            [[f"{r['model']} ({r['threads']} threads)"] + [
                                f"{r['seconds'][k]:.2f} ({r['load'][k]:.1f})" if k in r["seconds"] else "-"
                                for k in keys] for r in firsts])
    p = next((p for r in q for p in r.get("peer", {}).values() if "versions" in p), None)
    if p:
        t += (f"\n\nllm-compressor {p['versions']['llmcompressor']} (compressed-tensors "
              f"{p['versions']['compressed_tensors']}, transformers {p['versions']['transformers']}, torch "
              f"{p['versions']['torch']}); its expert weights read fake-quantized after oneshot, on its int4 grid to "
              f"{max(x.get('grid_error', 0) for r in q for x in r.get('peer', {}).values()):.1e}.")
    for (model, k), err in failed.items():
        t += f"\n\nllm-compressor {k} on {model} failed: {err}"
    return t


if __name__ == "__main__":
    main()
