"""qtransform on an NVIDIA GPU in one run of a few minutes (issue 31): GPTQ, calibrated W8A8, tokens/s.

Randomly initialised Llama models of real shapes are built on the spot (bench/gpu_common.py; no
files): SmolLM2-135M, TinyLlama-1.1B and one Llama-3-8B decoder layer (vocabulary 1024).

1. ``gptq``: the ``gptq4-g64`` preset on the SmolLM2 and 1.1B shapes (fp32 weights, fixed random
   calibration tokens, printed), timed on the device; then the CPU path on the first
   ``--cpu-blocks`` decoder layers of the same weights and tokens (a truncated copy: those layers
   see the same inputs as in the whole model) and the fraction of equal codes. The CPU time of the
   same job on the development machine comes from ``--reference`` (written by ``--cpu-reference``).
2. ``w8a8``: the calibrated ``fp8-w8a8`` and ``w8a8-int8`` presets on the SmolLM2 shape: time to
   quantize, the kernel each linear layer runs (``module.kernel``; a CUDA kernel that is eligible
   but not chosen by ``auto`` is forced and reported), logits' relative error against bf16.
3. ``speed``: prefill (1 x ``--prefill`` tokens) and decode (``--decode`` steps of one token with a
   key/value cache after a 32-token prompt) tokens/s for bf16, ``int4-g128`` (RTN) and
   ``fp8-w8a8`` on the three shapes: CUDA events, warm-ups, medians.

Every case catches its own error (the reason goes in the table) and the JSON is rewritten after
each, so a time limit still leaves what was measured. ``--budget`` seconds: cases not started by then
are skipped. ``--device cpu --small``: tiny shapes in seconds, the same code paths (a smoke test).

The CPU reference (bench/results/gpu_cpu_reference.json) was measured on the 2-core development
machine (AMD EPYC, 2 threads, load average 0.9-2.0): SmolLM2 shape whole, 1.1B shape on its first
layer only, scaled by 22 (marked ``est.``). On a shared machine 2 threads are fragile: the same job
took 444 s instead of 98 s at load 3-6; one thread (OMP_NUM_THREADS=1) gave 131 s and 59 s/layer.

    python3 bench/bench_gpu.py --out bench/results/gpu.json              # on the GPU machine
    python3 bench/bench_gpu.py --device cpu --cpu-reference              # the CPU reference, here
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bridge/ and qtransform/ from the checkout (not installed on the GPU machine)
sys.path.insert(0, str(ROOT / "bench"))

import warnings  # noqa: E402

import torch  # noqa: E402

import gpu_common as G  # noqa: E402
from common import kernels_used  # noqa: E402

REFERENCE = ROOT / "bench" / "results" / "gpu_cpu_reference.json"
PROMPT = 32


class Run:
    def __init__(self, a):
        self.a, self.t0 = a, time.perf_counter()
        self.out = {"machine": G.machine(a.device), "args": vars(a) | {"out": str(a.out)},
                    "gptq": [], "w8a8": [], "speed": []}

    def left(self) -> float:
        return self.a.budget - (time.perf_counter() - self.t0)

    def add(self, section: str, row: dict) -> None:
        row["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.out[section].append(row)
        print(f"[{section}] " + json.dumps(row), flush=True)
        self.save()

    def save(self) -> None:
        if torch.device(self.a.device).type == "cuda":
            self.peak = max(getattr(self, "peak", 0), torch.cuda.max_memory_allocated(self.a.device))
            self.out["machine"]["peak_gpu_memory_gb"] = round(self.peak / 2**30, 3)
        self.a.out.parent.mkdir(parents=True, exist_ok=True)
        self.a.out.write_text(json.dumps(self.out, indent=2) + "\n")


def gptq_case(run: Run, shape: str, n: int) -> dict:
    import bridge
    import qtransform as qt

    a, dev = run.a, run.a.device
    recipe = qt.get_preset("gptq4-g64").recipe
    row = {"shape": shape, "calibration": f"{n} x {a.seq} tokens (batches of {a.batch}, random ids, seed 1)",
           "load_before": [round(x, 2) for x in os.getloadavg()]}
    layers = G.SHAPES[shape]["num_hidden_layers"]
    blocks = min(a.cpu_blocks, layers) if not a.cpu_reference else min(a.ref_blocks.get(shape) or layers, layers)
    # the CPU reference times the first blocks of the model (scaled to the whole model when fewer)
    model = G.build_model(shape, dev, layers=blocks if a.cpu_reference else None)
    calib = G.calibration(model.config.vocab_size, n, a.seq, a.batch)
    G.reset_peak(dev)
    cpu0 = time.process_time()
    r, secs = G.timed(lambda: bridge.quantize_params(model, recipe, calibration=calib), dev)
    row.update(device=dev, blocks=blocks if a.cpu_reference else layers, seconds=round(secs, 2),
               process_cpu_s=round(time.process_time() - cpu0, 1), peak_gpu_gb=G.peak_gb(dev))
    if a.cpu_reference:
        row["seconds_whole_model"] = round(secs * layers / blocks, 1)
        row["extrapolated"] = blocks < layers
        return row
    if blocks > 0:  # the CPU path on the same weights and tokens, first blocks only (CPU vs CPU in a smoke test)
        small = G.truncated_copy(model, blocks, "cpu")
        rc, cpu_secs = G.timed(lambda: bridge.quantize_params(small, recipe, calibration=calib), "cpu")
        prefixes = tuple(f"model.layers.{i}." for i in range(blocks))
        row["vs_cpu"] = {"blocks": blocks, "cpu_seconds_this_machine": round(cpu_secs, 2),
                         **G.compare_codes(r.qtree, rc.qtree, prefixes)}
    ref = reference(a).get(shape)
    if ref:
        row["cpu_reference"] = ref
        row["speedup_vs_cpu_reference"] = round(ref["seconds_whole_model"] / secs, 1)
    return row


def reference(a) -> dict:
    path = Path(a.reference)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {r["shape"]: {"seconds_whole_model": r["seconds_whole_model"], "extrapolated": r["extrapolated"],
                         "blocks": r["blocks"], "calibration": r["calibration"], "machine": data["machine"]["cpu"],
                         "threads": data["machine"]["cpu_threads"], "load_before": r.get("load_before"),
                         "process_cpu_s": r.get("process_cpu_s")}
            for r in data.get("gptq", []) if "seconds_whole_model" in r}


def w8a8_case(run: Run, shape: str, preset: str) -> dict:
    import bridge
    import qtransform as qt

    a, dev = run.a, run.a.device
    model = G.build_model(shape, dev)
    calib = G.calibration(model.config.vocab_size, a.w8a8_calib, a.seq, a.batch, seed=2)
    ids = G.calibration(model.config.vocab_size, 1, a.seq, 1, seed=3)[0].to(dev)
    G.reset_peak(dev)
    qmodel, secs = G.timed(lambda: bridge.quantize(model, qt.get_preset(preset).recipe, calibration=calib), dev)
    model, qmodel = model.to(torch.bfloat16), qmodel.to(torch.bfloat16)  # run in bf16, as served
    row = {"shape": shape, "preset": preset, "calibration": f"{a.w8a8_calib} x {a.seq} tokens",
           "quantize_s": round(secs, 2), "kernels": kernels_used(qmodel), "available": G.available_kernels(qmodel)}
    wanted = [k for k in row["available"].split(", ") if "cuda" in k or k == "fp8_scaled_mm"]
    if wanted and wanted[0] not in row["kernels"]:  # eligible on this device but not chosen by auto
        forced = 0
        for m in qmodel.modules():
            if isinstance(m, bridge.QLinear) and wanted[0] in m.available_kernels():
                m.kernel, forced = wanted[0], forced + 1
        row["forced"] = f"{wanted[0]} x{forced}"
        row["kernels"] = kernels_used(qmodel)
    with torch.no_grad():
        ref = model(ids, logits_to_keep=0).logits.float()
        got = qmodel(ids, logits_to_keep=0).logits.float()
    row["logits_rel_err_vs_bf16"] = round(float((got - ref).norm() / ref.norm()), 4)
    row["peak_gpu_gb"] = G.peak_gb(dev)
    return row


def make_variant(run: Run, shape: str, variant: str):
    import bridge
    import qtransform as qt

    a, dev = run.a, run.a.device
    model = G.build_model(shape, dev, dtype=torch.float32 if variant != "bf16" else torch.bfloat16)
    if variant == "int4-g128":
        model = bridge.quantize(model, qt.get_preset("int4-g128").recipe, inplace=True)
    elif variant == "fp8-w8a8":
        calib = G.calibration(model.config.vocab_size, 4, min(a.seq, 256), 2, seed=2)
        model = bridge.quantize(model, qt.get_preset("fp8-w8a8").recipe, inplace=True, calibration=calib)
    return model.to(torch.bfloat16)


def speed_case(run: Run, shape: str, variant: str) -> dict:
    a, dev = run.a, run.a.device
    G.reset_peak(dev)
    model = make_variant(run, shape, variant)
    row = {"shape": shape, "variant": variant, "kernels": kernels_used(model)}
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, vocab, (1, a.prefill), generator=gen).to(dev)
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=gen).to(dev)

    def prefill():
        model(ids, use_cache=False, logits_to_keep=1)

    def decode(steps=a.decode):
        out = model(prompt, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        G.sync(dev)
        t = time.perf_counter()
        for _ in range(steps):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        G.sync(dev)
        return time.perf_counter() - t

    linears = [m for n, m in model.named_modules() if hasattr(m, "in_features") and "lm_head" not in n]
    xs = [torch.randn(1, 1, m.in_features, device=dev, dtype=torch.bfloat16) for m in linears]

    def gemv(reps=20):  # every linear of the decoder at one token, back to back: the kernels' own time
        for _ in range(reps):
            for m, x in zip(linears, xs):
                m(x)

    with torch.no_grad():
        row["decode_linears_us"] = round(G.median_time(gemv, dev, repeat=a.repeat, warmup=1) / 20 * 1e6, 1)
        s = G.median_time(prefill, dev, repeat=a.repeat, warmup=2)
        row["prefill_tok_s"] = round(a.prefill / s, 1)
        decode(4)
        times = sorted(decode() for _ in range(max(1, a.repeat // 2)))
        row["decode_tok_s"] = round(a.decode / times[len(times) // 2], 1)
    row["peak_gpu_gb"] = G.peak_gb(dev)
    return row


def cases(a):
    big = ["smollm2-135m", "tinyllama-1.1b"] if not a.small else ["tiny", "tiny-wide"]
    n = {big[0]: a.calib_small, big[1]: a.calib_1b}
    gptq = [("gptq", {"shape": s}, lambda run, s=s: gptq_case(run, s, n[s])) for s in big]
    if a.cpu_reference:
        return gptq
    out = [("w8a8", {"shape": big[0], "preset": p}, lambda run, p=p: w8a8_case(run, big[0], p))
            for p in ("fp8-w8a8", "w8a8-int8")]
    for s in big + (["llama3-8b-layer"] if not a.small else []):
        out += [("speed", {"shape": s, "variant": v}, lambda run, s=s, v=v: speed_case(run, s, v))
                for v in ("bf16", "int4-g128", "fp8-w8a8")]
    out += gptq  # the longest last
    return [c for c in out if not a.only or c[0] in a.only]


def table(out: dict) -> str:
    m = out["machine"]
    lines = [f"**{m.get('gpu', m['cpu'])}** (capability {m.get('capability', '-')}), torch {m['torch']} "
             f"(CUDA {m.get('cuda', '-')}), transformers {m['transformers']}, peak GPU memory "
             f"{m.get('peak_gpu_memory_gb', '-')} GB", "",
             "| GPTQ gptq4-g64 | calibration | device s | CPU s (reference) | x | codes equal to CPU's (blocks) |",
             "|---|---|---|---|---|---|"]
    for r in out["gptq"]:
        ref, vs = r.get("cpu_reference") or {}, r.get("vs_cpu") or {}
        load = (ref.get("load_before") or [None])[0]
        refs = (f"{ref['seconds_whole_model']}{' est.' if ref['extrapolated'] else ''} ({ref['threads']} threads, "
                f"load {load})" if ref else "-")
        eq = (f"{vs['equal_fraction']:.6f} ({vs['blocks']}), max diff {vs['max_code_diff']}"
              if vs.get("equal_fraction") is not None else "-")
        secs = r.get("seconds", r.get("error", ""))
        if r.get("extrapolated"):
            secs = f"{secs} ({r['blocks']} layers; whole model est. {r['seconds_whole_model']})"
        lines.append(f"| {r['shape']} | {r.get('calibration', '')} | {secs} | {refs} | "
                     f"{r.get('speedup_vs_cpu_reference', '-')} | {eq} |")
    lines += ["", "| W8A8 (smollm2 shape) | quantize s | kernels | logits rel. err vs bf16 |", "|---|---|---|---|"]
    for r in out["w8a8"]:
        lines.append(f"| {r.get('preset')} | {r.get('quantize_s', r.get('error', ''))} | {r.get('kernels', '')} "
                     f"{'(forced)' if r.get('forced') else ''} | {r.get('logits_rel_err_vs_bf16', '-')} |")
    a = out["args"]
    lines += ["", f"| shape | variant | prefill tok/s (1x{a['prefill']}) | decode tok/s ({a['decode']} steps) | kernels "
              "| decode: all linears at 1 token, µs | peak GPU GB (build+run) |", "|---|---|---|---|---|---|---|"]
    for r in out["speed"]:
        lines.append(f"| {r['shape']} | {r['variant']} | {r.get('prefill_tok_s', r.get('error', ''))} | "
                     f"{r.get('decode_tok_s', '-')} | {r.get('kernels', '')} | {r.get('decode_linears_us', '-')} | "
                     f"{r.get('peak_gpu_gb', '-')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default bench/results/gpu.json, "
                    "or bench/results/gpu_cpu_reference.json with --cpu-reference)")
    ap.add_argument("--small", action="store_true", help="tiny shapes and lengths (a smoke test in seconds)")
    ap.add_argument("--cpu-reference", action="store_true",
                    help="only the GPTQ cases, timed on this device (the reference the GPU run compares with)")
    ap.add_argument("--reference", default=str(REFERENCE), help="the CPU reference JSON the GPU run reads")
    ap.add_argument("--calib-small", type=int, default=32, help="calibration sequences, SmolLM2 shape")
    ap.add_argument("--calib-1b", type=int, default=32, help="calibration sequences, 1.1B shape")
    ap.add_argument("--w8a8-calib", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cpu-blocks", type=int, default=2, help="decoder layers the CPU comparison runs")
    ap.add_argument("--ref-blocks-1b", type=int, default=2,
                    help="--cpu-reference: layers of the 1.1B shape timed (the whole model's time extrapolated)")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds after which no new case starts")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's; OMP_NUM_THREADS)")
    ap.add_argument("--cudnn-attention", action="store_true", help="leave cuDNN's SDPA backend on (torch's default)")
    ap.add_argument("--only", nargs="*", default=None, choices=["gptq", "w8a8", "speed"])
    a = ap.parse_args(argv)
    if a.out is None:
        a.out = ROOT / "bench" / "results" / ("gpu_cpu_reference.json" if a.cpu_reference else "gpu.json")
    if a.small:
        a.seq, a.batch, a.prefill, a.decode, a.repeat = 64, 4, 128, 8, 3
        a.calib_small, a.calib_1b, a.w8a8_calib = min(a.calib_small, 8), min(a.calib_1b, 8), min(a.w8a8_calib, 4)
    a.ref_blocks = {"tinyllama-1.1b": a.ref_blocks_1b, "tiny-wide": min(a.ref_blocks_1b, 1)}
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --small for a smoke test)")
    if a.threads:
        torch.set_num_threads(a.threads)
    if torch.device(a.device).type == "cuda" and not a.cudnn_attention:
        # torch 2.11's SDPA picks cuDNN attention for bf16; at decode (a new key length each step) it spent
        # 2.0 ms of host time per call on an H200 (bench/gpu_crossover.py's profile): ~60 ms per step of SmolLM2,
        # whatever the weights. Flash / memory-efficient attention instead, for every variant alike.
        torch.backends.cuda.enable_cudnn_sdp(False)
    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # newer transformers rename it; 5.17 has it
    run = Run(a)
    m = run.out["machine"]
    print(f"# {m.get('gpu', m['cpu'])} | torch {m['torch']} | transformers {m['transformers']} | "
          f"{m['cpu_threads']} CPU threads", flush=True)
    for section, label, fn in cases(a):
        if run.left() <= 0:
            run.add(section, {**label, "error": "skipped: --budget spent"})
            continue
        try:
            row = fn(run)
        except Exception as e:  # noqa: BLE001 - the reason goes in the table
            row = {**label, "error": G.short_error(e)}
            traceback.print_exc()
        gc.collect()
        if torch.device(a.device).type == "cuda":
            torch.cuda.empty_cache()
        run.add(section, row)
    run.out["total_s"] = round(time.perf_counter() - run.t0, 1)
    run.save()
    md = table(run.out)
    a.out.with_suffix(".md").write_text(md + "\n")
    print("\n" + md)


if __name__ == "__main__":
    main()
