"""Int4 weight-only linear at decode (1 to 8 tokens) on CPU: every available path against fp32 F.linear.

One random int4 weight per shape (asymmetric, per-group scales and zero points, group 128 unless
``--group``, else the largest of 256..32 dividing in_features: 64 for SmolLM2's 576), run through each candidate that can hold it:

* ``fp32`` / ``bf16``: ``F.linear`` on the dequantized weight (the baseline and the 16-bit peer);
* ``int4pack``: ``aten._weight_int4pack_mm_for_cpu`` (bf16 compute), qtransform's ``int4pack_cpu``;
* ``int8pack``: ``aten._weight_int8pack_mm`` on an int8 per-channel weight (bf16; twice the bytes);
* ``ao-da8w4``, ``ao-kleidiai``, ``dyn-quant-4bit``: torchao's int8-activation int4 kernel, its
  opaque KleidiAI/lowbit layouts and ``aten._dyn_quant_matmul_4bit`` (reported as "not run here"
  with the reason where this CPU or build lacks them: on x86 without torchao's C++ kernels, all);
* ``dequant+gemm``: unpack and dequantize the whole weight each call, then fp32 ``F.linear`` (the
  many-token path; not in the default set);
* ``ao-a16w4``: torchao's CPU int4 weight-only tensor (``Int4OpaqueTensor``, bf16 activations);
* ``inductor`` / ``inductor-ma``: ``torch.compile`` of a plain-torch dequant + GEMV over the nibbles
  (default mode / ``max-autotune-no-cudagraphs``, static shapes; only with ``--inductor``: a compile
  per shape and token count);
* ``decode`` / ``decode-exact``: qtransform's ``int4_decode_linear`` (``bridge/kernels/decode.py``:
  int16-rounded activations / fp32 FMA).

Cold cache by default: each candidate cycles through enough copies of its weight to fill
``--cold-mb`` MiB (64: twice the L3 here), as in a real decode step where every layer's weight
streams from memory; ``--cold-mb 0`` reuses one copy (hot). Times: median over interleaved repeats of the per-call mean of a
batch of calls (``common.timeit`` style; the machine is shared: the load average is recorded).

    python bench/bench_decode.py [--threads 1,2] [--shapes 4096x4096,smollm2] [--tokens 1,2,4,8]

Writes bench/results/decode.json and bench/results/decode.md (``--out`` renames).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from common import markdown, write

SMOLLM2 = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "up/gate 1536x576": (1536, 576),
           "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}


def weight(n: int, k: int, g: int, gen: torch.Generator):
    """Random int4 codes (0..15), scales, integer zero points and the dequantized fp32 weight."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    s = torch.rand(n, k // g, generator=gen) * 0.01 + 0.001
    z = torch.randint(0, 16, (n, k // g), generator=gen).float()
    w = ((codes.float().view(n, -1, g) - z[..., None]) * s[..., None]).view(n, k)
    return codes, s, z, w


def c_fp32(codes, s, z, w, g):
    return w.clone(), lambda x, st: F.linear(x, st)


def c_bf16(codes, s, z, w, g):
    return w.to(torch.bfloat16), lambda x, st: F.linear(x.to(torch.bfloat16), st).float()


def c_int4pack(codes, s, z, w, g):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2)
    sz = torch.stack([s.t(), ((8 - z) * s).t()], dim=-1).to(torch.bfloat16).contiguous()
    return (packed, sz), lambda x, st: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), st[0], g, st[1]).float()


def c_int8pack(codes, s, z, w, g):
    sc = w.abs().amax(1).clamp_min(1e-8) / 127
    q = torch.round(w / sc[:, None]).to(torch.int8).contiguous()
    return (q, sc.to(torch.bfloat16)), lambda x, st: torch.ops.aten._weight_int8pack_mm(
        x.to(torch.bfloat16), st[0], st[1]).float()


def c_ao_a16w4(codes, s, z, w, g):
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(lin, PrototypeInt4WeightOnlyConfig(group_size=g))  # its own RTN of w: same bytes, same kernel
    return lin, lambda x, st: st(x.to(torch.bfloat16)).float()


def c_ao_da8w4(codes, s, z, w, g):
    """torchao's int8-activation x int4-weight CPU kernel (needs its C++ extension)."""
    from torchao.prototype.quantization.int4.inference_workflow import Int8DynamicActivationInt4WeightConfig
    from torchao.quantization import quantize_
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    quantize_(lin, Int8DynamicActivationInt4WeightConfig(group_size=g))
    return lin, lambda x, st: st(x)


def c_ao_kleidiai(codes, s, z, w, g):
    """torchao's opaque int4 CPU layouts (KleidiAI / its lowbit kernels)."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    quantize_(lin, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(g),
                                        intx_packing_format="opaque_aten_kleidiai"))
    return lin, lambda x, st: st(x)


def c_dyn_quant_4bit(codes, s, z, w, g):
    """``aten._dyn_quant_matmul_4bit`` (int8 activations x int4 weights; KleidiAI on Arm)."""
    if not torch.backends.kleidiai.is_available():
        raise RuntimeError("no KleidiAI here: aten._dyn_quant_pack_4bit_weight keeps a dense fp32 copy "
                           "(no 4-bit storage) on this CPU")
    n, k = codes.shape
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(codes.to(torch.uint8), s, None, g, k, n)
    return packed, lambda x, st: torch.ops.aten._dyn_quant_matmul_4bit(x, st, g, k, n)


def c_dequant_gemm(codes, s, z, w, g):
    """Dequantize the whole weight from bytes of two nibbles each call, then fp32 F.linear."""
    n, k = codes.shape
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous()

    def run(x, st):
        p, sc, zz = st
        q = torch.stack([p & 15, p >> 4], dim=-1).view(n, -1, g).float()
        return F.linear(x, ((q - zz[..., None]) * sc[..., None]).view(n, k))
    return (packed, s.clone(), z.clone()), run


def _nibble_gemv(x, packed, s, mz):
    """Plain-torch dequant + GEMV over bytes holding two codes (low: first half of each group)."""
    n, groups, half = packed.shape
    xs = x.view(-1, 1, groups, 2 * half)
    d = (xs[..., :half] * (packed & 15).float() + xs[..., half:] * (packed >> 4).float()).sum(-1)
    return (d * s + xs.sum(-1) * mz).sum(-1)


@functools.cache
def _compiled(mode):
    """One compiled function per mode, shared by all copies (a new wrapper per copy recompiles);
    modes and shapes share one code object, hence the higher recompile limit."""
    torch._dynamo.config.recompile_limit = 64
    return torch.compile(_nibble_gemv, mode=mode, dynamic=False, fullgraph=True)


def _inductor(mode):
    def build(codes, s, z, w, g):
        n, k = codes.shape
        cg = codes.to(torch.uint8).view(n, k // g, g)
        packed = (cg[..., : g // 2] | (cg[..., g // 2:] << 4)).contiguous()
        fn = _compiled(mode)
        return (packed, s.contiguous(), (-s * z).contiguous()), lambda x, st: fn(x, *st)
    return build


def _decode(exact):
    def build(codes, s, z, w, g):
        from bridge.kernels.decode import int4_decode_linear, prepare_decode
        return prepare_decode(codes, s, z, exact=exact), int4_decode_linear
    return build


CANDIDATES = {"fp32": c_fp32, "bf16": c_bf16, "int4pack": c_int4pack, "int8pack": c_int8pack,
              "ao-a16w4": c_ao_a16w4, "ao-da8w4": c_ao_da8w4, "ao-kleidiai": c_ao_kleidiai,
              "dyn-quant-4bit": c_dyn_quant_4bit, "dequant+gemm": c_dequant_gemm, "inductor": _inductor(None),
              "inductor-ma": _inductor("max-autotune-no-cudagraphs"), "decode": _decode(False), "decode-exact": _decode(True)}
DEFAULT = ("fp32", "bf16", "int4pack", "int8pack", "ao-a16w4", "ao-da8w4", "ao-kleidiai", "dyn-quant-4bit",
           "decode", "decode-exact")


def nbytes(st) -> int:
    if isinstance(st, torch.Tensor):
        return st.numel() * st.element_size()
    if isinstance(st, torch.nn.Module):  # a torchao tensor subclass: count what it stores
        wt = st.weight
        return sum(nbytes(getattr(wt, f)) for f in ("qdata", "scale_and_zero") if getattr(wt, f, None) is not None)
    if isinstance(st, (tuple, list)):
        return sum(nbytes(t) for t in st if isinstance(t, (torch.Tensor, tuple, list)))
    return 0


def cycler(fn, copies, x):
    """``fn(x, copy)`` over the copies in turn (a fresh weight each call when cold)."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(copies)
        return fn(x, copies[state["i"]])
    return call


def timeit(fns: dict, *, repeat: int, target_s: float = 0.004) -> dict[str, float]:
    """Median over ``repeat`` interleaved rounds of the mean time per call of a batch of calls."""
    inner = {}
    for name, fn in fns.items():
        fn(), fn()
        t = time.perf_counter()
        fn()
        inner[name] = max(1, min(200, int(target_s / max(time.perf_counter() - t, 1e-7))))
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            times[name].append((time.perf_counter() - t) / inner[name])
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(shapes, tokens, threads, names, group, cold_mb, repeat):
    gen = torch.Generator().manual_seed(0)
    rows, skipped = [], {}
    for label, (n, k) in shapes.items():
        g = next(c for c in (group, 256, 128, 64, 32, 16, k) if k % c == 0)  # SmolLM2's 576 takes 64
        codes, s, z, w = weight(n, k, g, gen)
        built = {}
        for name in names:
            try:
                st, fn = CANDIDATES[name](codes, s, z, w, g)
                size = max(nbytes(st), 1)
                copies = [st] + [CANDIDATES[name](codes, s, z, w, g)[0] for _ in range(
                    math.ceil(cold_mb * 2**20 / size) - 1)]
                built[name] = (fn, copies, size)
            except Exception as e:  # a peer that cannot run here is reported, not fatal
                skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        for m in tokens:
            x = torch.randn(m, k, generator=gen)
            ref = F.linear(x, w)
            for t in threads:
                torch.set_num_threads(t)
                fns = {name: cycler(fn, copies, x) for name, (fn, copies, _) in built.items()}
                ms = timeit(fns, repeat=repeat)
                for name, sec in ms.items():
                    y = built[name][0](x, built[name][1][0]).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    rows.append({"shape": label, "weight": [n, k], "group": g, "tokens": m, "threads": t,
                                 "path": name, "ms": round(sec * 1e3, 4), "weight_mb": round(built[name][2] / 2**20, 2),
                                 "x_fp32": round(ms["fp32"] / sec, 2) if "fp32" in ms else None,
                                 "max_rel_err": float(f"{err:.2e}")})
                print(f"{label} tokens={m} threads={t}: " + ", ".join(
                    f"{nm} {sec * 1e3:.3f}ms" for nm, sec in ms.items()), flush=True)
    return rows, skipped


def table(rows, skipped, meta) -> str:
    head = (f"torch {torch.__version__}, CPU capability {meta['cpu_capability']}, {meta['cache']} cache, "
            f"{meta['repeat']} repeats; load average before {meta['load_before']}, after {meta['load_after']}.\n"
            "ms: median per call; x fp32: fp32 F.linear's time over the path's (above 1: faster); "
            "max rel err: max |y - F.linear(x, dequant)| / max |F.linear(x, dequant)|.\n\n")
    paths = list(dict.fromkeys(r["path"] for r in rows))
    cells = {}
    for r in rows:
        cells.setdefault((r["shape"], r["tokens"], r["threads"]), {})[r["path"]] = r
    body = markdown(["weight (out x in)", "tokens", "threads"] + [f"{p} ms (x fp32)" for p in paths],
                    [[s, m, t] + [f"{c[p]['ms']:.4f} ({c[p]['x_fp32']:.2f})" if p in c else "-" for p in paths]
                     for (s, m, t), c in cells.items()])
    errs = {p: max(r["max_rel_err"] for r in rows if r["path"] == p) for p in paths}
    tail = "\n\nmax rel err over all cells: " + ", ".join(f"{p} {e:.1e}" for p, e in errs.items())
    if skipped:
        tail += "\n\nnot run here: " + "; ".join(f"{p}: {why}" for p, why in skipped.items())
    return head + body + tail


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--shapes", default="4096x4096,smollm2",
                    help="comma-separated OUTxIN shapes or SmolLM2 layer names; 'smollm2' = all of them")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--paths", default=",".join(DEFAULT), help=f"candidates among {list(CANDIDATES)}")
    ap.add_argument("--inductor", action="store_true", help="add the torch.compile candidates")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--cold-mb", type=int, default=64,
                    help="MiB of weight copies each path cycles through (0: one hot copy; default 2x this L3)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default="decode")
    a = ap.parse_args()
    shapes = {}
    for item in a.shapes.split(","):
        if item == "smollm2":
            shapes.update(SMOLLM2)
        elif item in SMOLLM2:
            shapes[item] = SMOLLM2[item]
        else:
            n, k = (int(v) for v in item.lower().split("x"))
            shapes[item] = (n, k)
    names = [p for p in a.paths.split(",") if p] + (["inductor", "inductor-ma"] if a.inductor else [])
    unknown = [p for p in names if p not in CANDIDATES]
    if unknown:
        ap.error(f"unknown paths {unknown}; choose among {list(CANDIDATES)}")
    meta = {"load_before": tuple(round(v, 2) for v in os.getloadavg()), "cache": f"cold ({a.cold_mb} MiB of copies)" if a.cold_mb else "hot", "repeat": a.repeat,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    with torch.no_grad():
        rows, skipped = run(shapes, [int(v) for v in a.tokens.split(",")], [int(v) for v in a.threads.split(",")],
                            names, a.group, a.cold_mb, a.repeat)
    meta["load_after"] = tuple(round(v, 2) for v in os.getloadavg())
    write(a.out, rows, table(rows, skipped, meta), extra={**meta, "skipped": skipped})


if __name__ == "__main__":
    main()
