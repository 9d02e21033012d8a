"""Where fp8 W8A8 + fp8 KV cache loses quality on SmolLM2-135M: weights, input activations, keys, values
alone and together, per-tensor vs per-head cache scales, the scale statistic (absmax, percentile, MSE),
R3 (Hadamard on queries and keys) before the cache. Fake quantization by hooks on one model loaded once;
scales from calibration data (the built-in corpus's calibration part), perplexity on its evaluation part
(or on ``--corpus FILE``). Activation scales other than absmax: see docs/performance.md (MSE x1.033,
percentile x4.86 on fp8-w8a8: clipping the outliers fp8 can hold costs more than it gains).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/fp8_kv_ablation.py [--calib 16] [--eval 8] [--only ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

import qtransform as qt
from qtransform.rotation import hadamard_transform

sys.path.insert(0, os.path.dirname(__file__))

FP8_MAX = 448.0


def fq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 fake quantization with ``scale`` (broadcast)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


def mse_scale(x: torch.Tensor, dims, grid: int = 36, lo: float = 0.3) -> torch.Tensor:
    """The absmax-over-448 scale times the ratio in ``linspace(lo, 1, grid)`` with the least squared error
    (reduced over ``dims``; other axes each get their own ratio)."""
    amax = x.abs().amax(dim=dims, keepdim=True).clamp_min(1e-12)
    best, best_err = None, None
    for r in torch.linspace(lo, 1.0, grid):
        s = amax * r / FP8_MAX
        err = (fq(x, s) - x).pow(2).sum(dim=dims, keepdim=True)
        if best is None:
            best, best_err = s.clone(), err
        else:
            better = err < best_err
            best = torch.where(better, s, best)
            best_err = torch.where(better, err, best_err)
    return best


def pct_scale(x: torch.Tensor, dims, p: float) -> torch.Tensor:
    a = x.abs().float()
    if dims is None or dims == tuple(range(x.dim())):
        flat = a.flatten()
        if flat.numel() > 8_000_000:
            flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:8_000_000]]
        return (torch.quantile(flat, p / 100) / FP8_MAX).reshape([1] * x.dim())
    # per head: axis 1 kept
    moved = a.transpose(0, 1).reshape(a.shape[1], -1)
    return (torch.quantile(moved, p / 100, dim=1) / FP8_MAX).reshape(1, -1, *[1] * (x.dim() - 2))


def scale_of(x: torch.Tensor, rule: str, per_head: bool) -> torch.Tensor:
    dims = (0, 2, 3) if per_head else (0, 1, 2, 3)
    if rule == "absmax":
        return x.abs().amax(dim=dims, keepdim=True) / FP8_MAX
    if rule.startswith("absmax*"):  # per head with headroom: m x the head's absmax, at most the tensor's
        m = float(rule[len("absmax*"):])
        return torch.minimum(m * x.abs().amax(dim=dims, keepdim=True), x.abs().amax()) / FP8_MAX
    if rule == "mse":
        return mse_scale(x, dims)
    if rule.startswith("p"):
        return pct_scale(x, None if not per_head else dims, float(rule[1:]))
    raise ValueError(rule)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--eval", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--corpus", default="builtin", help="evaluation text: builtin (its eval part) or a file")
    ap.add_argument("--no-w", action="store_true", help="key/value runs only, on the float model (no weight quantization)")
    a = ap.parse_args()
    import bridge
    from bridge.app import corpus, evaluate, models
    from bridge.modules import kvcache

    t0 = time.time()
    model, tok = models.load_with_tokenizer()
    model.eval()
    evtext = corpus.load_text(a.corpus, part="eval") if a.corpus == "builtin" else corpus.load_text(a.corpus)
    ev = corpus.token_sequences(evtext, tok, seq_len=a.seq_len, max_sequences=a.eval)
    cal = list(corpus.token_sequences(corpus.load_text("builtin", part="calibration"), tok, seq_len=a.seq_len,
                                      max_sequences=a.calib).split(4))
    W = qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0))
    wq = model if a.no_w else bridge.quantize(model, qt.Recipe(type_rules={"Linear": W}, exclude=["lm_head*"],
                                                               steps=[qt.Step("rtn", observer="mse")]), kernel="dequant")
    print("loaded + W quantized", round(time.time() - t0, 1), flush=True)

    attn = kvcache.attention_modules(model)
    lin = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.startswith("lm_head")]
    # calibration on the W model: K/V as the cache stores them, linear inputs (subsampled for MSE)
    kv = {p: {"k": [], "v": []} for p in attn}
    inputs = {n: {"amax": 0.0, "sample": []} for n in lin}
    g = torch.Generator().manual_seed(0)

    def kv_cb(p):
        def cb(k, v):
            kv[p]["k"].append(k.detach().half())
            kv[p]["v"].append(v.detach().half())
        return cb

    def in_hook(n):
        def hook(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            inputs[n]["amax"] = max(inputs[n]["amax"], x.abs().max().item())
            idx = torch.randint(0, x.shape[0], (64,), generator=g)
            inputs[n]["sample"].append(x[idx].half())
        return hook

    hooks = [wq.get_submodule(n).register_forward_pre_hook(in_hook(n)) for n in lin]
    with torch.no_grad(), kvcache.observing(wq, {p: kv_cb(p) for p in attn}):
        for b in cal:
            wq(b)
    for h in hooks:
        h.remove()
    K = {p: torch.cat(kv[p]["k"]).float() for p in attn}
    V = {p: torch.cat(kv[p]["v"]).float() for p in attn}
    X = {n: torch.cat(inputs[n]["sample"]).float() for n in lin}
    print("calibrated", round(time.time() - t0, 1), flush=True)

    # attention function quantizing K/V with scales set on the module
    def attention(module, query, key, value, *args, **kwargs):
        if getattr(module, "_x_r3", False):
            query, key = hadamard_transform(query), hadamard_transform(key)
        ks, vs = getattr(module, "_x_k", None), getattr(module, "_x_v", None)
        if ks is not None:
            key = fq(key, ks.to(key.dtype))
        if vs is not None:
            value = fq(value, vs.to(value.dtype))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, *args, **kwargs)

    AttentionInterface.register("xkv", attention)
    AttentionMaskInterface.register("xkv", ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"])

    def setup(m, *, kv_rule=None, per_head=False, k=True, v=True, r3=False, act=None, v_rule=None):
        for p in attn:
            mod = m.get_submodule(p)
            mod._x_r3 = r3
            kk = hadamard_transform(K[p]) if r3 else K[p]
            mod._x_k = scale_of(kk, kv_rule, per_head) if (kv_rule and k) else None
            mod._x_v = scale_of(V[p], v_rule or kv_rule, per_head) if (kv_rule and v) else None
        m.config._attn_implementation = "xkv"
        hs = []
        if act:
            for n in lin:
                x = X[n]
                if act == "absmax":
                    s = torch.tensor(inputs[n]["amax"] / FP8_MAX)
                elif act == "mse":
                    s = mse_scale(x, (0, 1)).reshape(())
                    s = torch.minimum(s, torch.tensor(inputs[n]["amax"] / FP8_MAX))
                else:
                    s = torch.quantile(x.abs().flatten()[:8_000_000], float(act[1:]) / 100) / FP8_MAX
                hs.append(m.get_submodule(n).register_forward_pre_hook(
                    lambda mod, args, s=s: (fq(args[0], s.to(args[0].dtype)),) + tuple(args[1:])))
        return hs

    fp = None
    results = {}
    runs = {
        "float": (model, {}),
        "W": (wq, {}),
        "A absmax": (model, {"act": "absmax"}),
        "KV absmax tensor": (model, {"kv_rule": "absmax"}),
        "K absmax tensor": (model, {"kv_rule": "absmax", "v": False}),
        "V absmax tensor": (model, {"kv_rule": "absmax", "k": False}),
        "KV absmax head": (model, {"kv_rule": "absmax", "per_head": True}),
        "KV absmax*2 head": (model, {"kv_rule": "absmax*2", "per_head": True}),
        "KV absmax*4 head": (model, {"kv_rule": "absmax*4", "per_head": True}),
        "KV absmax*16 head": (model, {"kv_rule": "absmax*16", "per_head": True}),
        "KV mse tensor": (model, {"kv_rule": "mse"}),
        "KV mse head": (model, {"kv_rule": "mse", "per_head": True}),
        "KV p99.99 tensor": (model, {"kv_rule": "p99.99"}),
        "KV p99.9 tensor": (model, {"kv_rule": "p99.9"}),
        "KV absmax tensor R3": (model, {"kv_rule": "absmax", "r3": True}),
        "KV absmax head R3": (model, {"kv_rule": "absmax", "per_head": True, "r3": True}),
        "WAKV absmax tensor": (wq, {"kv_rule": "absmax", "act": "absmax"}),
        "WAKV absmax head": (wq, {"kv_rule": "absmax", "per_head": True, "act": "absmax"}),
    }
    for name, (m, kw) in runs.items():
        if (a.only and name not in a.only and name != "float") or (a.no_w and (name == "W" or name.startswith("WA"))):
            continue
        hs = setup(m, **kw)
        with torch.no_grad():
            ppl = evaluate.perplexity(m, ev).perplexity
        for h in hs:
            h.remove()
        fp = fp or ppl
        results[name] = ppl / fp
        print(f"{name:28s} ppl {ppl:.3f} ratio x{ppl / fp:.4f}  ({time.time() - t0:.0f}s)", flush=True)
    print(json.dumps({k: round(v, 4) for k, v in results.items()}))
    from common import markdown, write

    tag = "builtin" if a.corpus == "builtin" else os.path.basename(a.corpus)
    name = f"fp8_kv_ablation_{tag}{'_kv_only' if a.no_w else ''}"
    rows = [{"run": k, "ratio": round(v, 4)} for k, v in results.items()]
    table = markdown(["run", "perplexity ratio"], [[r["run"], f"x{r['ratio']}"] for r in rows])
    table += (f"\n\nSmolLM2-135M; calibration {a.calib}x{a.seq_len} tokens (built-in calibration part), evaluation "
              f"{a.eval}x{a.seq_len} tokens of {tag}; load average {os.getloadavg()[0]:.1f}")
    write(name, rows, table, {"corpus": tag, "calib": a.calib, "eval": a.eval, "load_average": os.getloadavg()[0]})


if __name__ == "__main__":
    main()
