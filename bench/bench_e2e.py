"""End-to-end CPU speed: prefill and decode tokens/s of whole models, ours beside fp32, bf16 and torchao.

Models: ``smollm2`` (SmolLM2-135M-Instruct, the built-in default model, loaded offline by
``bridge.app.models.load_causal_lm``) and ``llama1b`` (TinyLlama-1.1B's shape: hidden 2048, MLP 5632,
22 layers, 32 heads, 4 key/value heads, vocabulary 32000; built from a ``LlamaConfig`` with random
N(0, 0.02) weights, seed 0: speed does not depend on the values).

Variants (``name[@fp32|@bf16]``, the dtype of everything a variant leaves in float):

* ``fp32``, ``bf16``: the float model;
* any preset of ``qtransform quantize`` (``int4-g128``, ``int8-channel``, ``hqq4-g64``,
  ``w8a8-int8-dynamic``...): ``bridge.quantize(model, preset.recipe, inplace=True)`` with the
  automatic kernel choice (``lm_head`` stays float, as in the presets); default dtype fp32;
* ``torchao-int4``: torchao 0.18's int4 weight-only CPU path, ``quantize_(model,
  PrototypeInt4WeightOnlyConfig(group_size=128))`` (``Int4OpaqueTensor``, the aten
  ``_weight_int4pack_mm_for_cpu`` kernel), every Linear but ``lm_head``; default dtype bf16 (its
  documented setting).

Phases, ``torch.no_grad``, batch 1, random token ids (seed 0):

* prefill: one forward of ``(1, T)`` tokens with ``use_cache=True`` and ``logits_to_keep=1`` (as
  ``generate`` does), T = 512 and 2048; one warm-up forward, then the median of ``--repeat``;
* decode: ``model.generate`` on a 32-token prompt with ``max_new_tokens = min_new_tokens = 128``,
  greedy, KV cache; new tokens / wall time of the whole call (its 32-token prefill included,
  nothing subtracted); one 4-token warm-up call, then the median of ``--repeat``.

Each (model, variant) runs in its own subprocess (this script with ``--worker``): one model alive at
a time, torchao's global state isolated, and its memory measured alone: ``peak RSS run`` is the
peak resident set while timing (``VmHWM`` reset through ``/proc/self/clear_refs`` after building
and quantizing), ``peak RSS all`` the peak of the whole subprocess (the fp32 model before
quantizing included).

    python bench/bench_e2e.py [--threads N] [--models smollm2,llama1b] [--variants fp32,int4-g128,...]
                              [--repeat R] [--out FILE.md] [--quick]

``--quick``: a tiny random Llama (4 layers, hidden 256) named ``llama1b``, prefill 32 and 64
tokens, 8 new tokens, one repeat: a smoke test in seconds. Without ``--out`` a full run writes
bench/results/e2e.{json,md}; a quick run only prints.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bridge/ next to qtransform/

from common import kernels_used, markdown  # noqa: E402

MODELS = ("smollm2", "llama1b")
VARIANTS = ("fp32", "bf16", "int4-g128", "int4-g128@bf16", "int8-channel", "hqq4-g64", "w8a8-int8-dynamic",
            "torchao-int4")
FLOATS = ("fp32", "bf16")
TORCHAO = "torchao-int4"
LLAMA1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=False)
PROMPT = 32
MARK = "E2E_RESULT "
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")


# ---------------------------------------------------------------- worker: one (model, variant)
def parse_variant(variant: str) -> tuple[str, str]:
    """``"int4-g128@bf16"`` -> ``("int4-g128", "bf16")``; the default dtype is fp32, bf16 for torchao."""
    name, _, dtype = variant.partition("@")
    dtype = dtype or (name if name in FLOATS else "bf16" if name == TORCHAO else "fp32")
    if dtype not in FLOATS:
        raise ValueError(f"--variants {variant}: dtype after '@' must be fp32 or bf16, got {dtype!r}")
    if name in FLOATS and dtype != name:
        raise ValueError(f"--variants {variant}: the float variants are fp32 and bf16")
    if name not in FLOATS and name != TORCHAO:
        import qtransform as qt

        try:
            qt.get_preset(name)
        except ValueError as e:
            raise ValueError(f"--variants {variant}: not fp32, bf16, {TORCHAO} or a preset: {e}") from None
    return name, dtype


def build_model(name: str, quick: bool):
    import torch

    if name == "smollm2":
        from bridge.app import models

        return models.load_causal_lm()  # fp32, eval mode, offline
    if name != "llama1b":
        raise ValueError(f"--models: unknown model {name!r}; choose from {', '.join(MODELS)}")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**(TINY if quick else LLAMA1B))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")  # no init pass: the weights are filled below
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its buffers came back empty
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for path, p in model.named_parameters():
            p.fill_(1.0) if path.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    stale = [b for b, _ in model.named_buffers() if not b.startswith("model.rotary_emb.")]
    if stale:
        raise RuntimeError(f"llama1b: buffers left uninitialised by to_empty: {stale}")
    return model.eval()


def make_variant(model, name: str, dtype: str):
    """The model of variant ``name`` in float ``dtype`` (in place), and the seconds spent quantizing."""
    import torch

    fdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    t = time.perf_counter()
    if name == TORCHAO:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import quantize_

        model = model.to(fdtype)
        quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=128, set_inductor_config=False),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and not fqn.startswith("lm_head"))
    elif name not in FLOATS:
        import bridge
        import qtransform as qt

        recipe = qt.get_preset(name).recipe
        qt.check_steps(recipe.steps, calibrated=False)
        static = [s for s in (recipe.input, recipe.output) if s is not None and not s.dynamic]
        if static:
            raise ValueError(f"{name} quantizes activations with static scales ({static[0]}), which need "
                             "calibration data: this benchmark runs only presets without calibration")
        model = bridge.quantize(model, recipe, inplace=True).to(fdtype)
    else:
        model = model.to(fdtype)
    return model, time.perf_counter() - t if name not in FLOATS else 0.0


def _rss_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def measure(model, prefill: tuple[int, ...], new_tokens: int, repeat: int) -> dict:
    import torch

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = {t: torch.randint(0, vocab, (1, t), generator=gen) for t in prefill}
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=gen)
    pad = model.generation_config.pad_token_id
    pad = model.generation_config.eos_token_id if pad is None else pad
    pad = (pad[0] if isinstance(pad, list) else pad) if pad is not None else 0
    out = {}
    with torch.no_grad():
        model(ids[min(prefill)], use_cache=True, logits_to_keep=1)  # warm-up: packing, allocator, caches
        for t in prefill:
            times = []
            for _ in range(repeat):
                s = time.perf_counter()
                model(ids[t], use_cache=True, logits_to_keep=1)
                times.append(time.perf_counter() - s)
            out[f"prefill_{t}"] = t / statistics.median(times)

        def decode(n):
            s = time.perf_counter()
            y = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
            if y.shape[-1] != PROMPT + n:
                raise RuntimeError(f"generate returned {y.shape[-1] - PROMPT} new tokens, expected {n}")
            return time.perf_counter() - s

        decode(4)
        out["decode"] = new_tokens / statistics.median(decode(new_tokens) for _ in range(repeat))
    return out


def worker(a) -> None:
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    name, dtype = parse_variant(a.variants)
    row = {"model": a.models, "variant": a.variants, "threads": torch.get_num_threads(), "load_before": os.getloadavg()}
    t = time.perf_counter()
    model = build_model(a.models, a.quick)
    row["parameters"] = sum(p.numel() for p in model.parameters())
    row["build_s"] = time.perf_counter() - t
    try:
        model, row["quantize_s"] = make_variant(model, name, dtype)
        row["kernels"] = kernels_used(model)
        gc.collect()
        row["rss_ready_gb"] = _rss_kb("VmRSS") / 2**20
        reset = _reset_peak()
        row.update(measure(model, a.prefill, a.new_tokens, a.repeat))
    except Exception as e:  # a path that does not run on this CPU: the reason goes in the table
        msg = str(e).strip().splitlines()
        row["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
        print(MARK + json.dumps(row), flush=True)
        return
    row["peak_rss_run_gb"] = _rss_kb("VmHWM") / 2**20 if reset else None
    row["peak_rss_all_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(MARK + json.dumps(row), flush=True)


# ---------------------------------------------------------------- parent: runs, table
def run_one(a, model: str, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--models", model, "--variants", variant, "--repeat", str(a.repeat),
           "--new-tokens", str(a.new_tokens), "--prefill", ",".join(map(str, a.prefill))]
    cmd += (["--threads", str(a.threads)] if a.threads else []) + (["--quick"] if a.quick else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "variant": variant, "error": f"timed out after {a.timeout} s"}
    rows = [json.loads(line[len(MARK):]) for line in p.stdout.splitlines() if line.startswith(MARK)]
    if not rows:
        tail = [ln for ln in p.stderr.splitlines() if ln.strip()][-1:] or [f"exit status {p.returncode}"]
        return {"model": model, "variant": variant, "error": f"worker failed (exit {p.returncode}): {tail[0][:300]}"}
    rows[0]["wall_s"] = time.perf_counter() - t
    return rows[0]


def machine() -> dict:
    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = re.search(r"model name\s*:\s*(.+)", info)
    found = re.search(r"flags\s*:\s*(.+)", info)
    flags = set(found.group(1).split()) if found else set()
    out = {"cpu": name.group(1).strip() if name else "unknown", "cores": os.cpu_count(),
           "flags": {f: f in flags for f in CPU_FLAGS}, "torch": torch.__version__,
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for pkg in ("transformers", "torchao"):
        try:
            out[pkg] = importlib.metadata.version(pkg)  # not imported here: torchao's import is slow and noisy
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def table(rows: list[dict], a, info: dict, load: dict) -> str:
    fp = {r["model"]: r for r in rows if r["variant"] == "fp32" and "error" not in r}
    ta = {r["model"]: r for r in rows if r["variant"] == TORCHAO and "error" not in r}
    phases = [f"prefill_{t}" for t in a.prefill] + ["decode"]
    head = (["model", "variant", "kernel(s)"] + [f"prefill tok/s @{t}" for t in a.prefill] + ["decode tok/s"]
            + [f"x fp32 prefill @{t}" for t in a.prefill] + ["x fp32 decode", "peak RSS run GB", "peak RSS all GB",
                                                             "quantize s"])
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["model"], r["variant"], r["error"]] + ["-"] * (len(head) - 3))
            continue
        base = fp.get(r["model"])
        ratios = [_f(r[p] / base[p], "{:.2f}") if base else "-" for p in phases]
        body.append([r["model"], r["variant"], r["kernels"]] + [_f(r[p]) for p in phases] + ratios
                    + [_f(r["peak_rss_run_gb"], "{:.2f}"), _f(r["peak_rss_all_gb"], "{:.2f}"),
                       _f(r["quantize_s"])])
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["flags"].items())
    threads = sorted({r["threads"] for r in rows if "threads" in r})
    params = {r["model"]: r["parameters"] for r in rows if "parameters" in r}
    lines = [f"CPU: {info['cpu']} ({info['cores']} logical cores; {flags}; torch CPU capability "
             f"{info['cpu_capability']}). torch {info['torch']}, transformers {info['transformers']}, torchao "
             f"{info['torchao']}; torch threads {threads}. Load average before "
             f"{tuple(round(v, 2) for v in load['before'])}, after {tuple(round(v, 2) for v in load['after'])}.",
             "Parameters: " + ", ".join(f"{m} {n / 1e6:.0f}M" for m, n in params.items())
             + (" (quick: llama1b is a tiny random Llama)" if a.quick else "") + ".",
             f"Prefill: one forward of (1, T) tokens (use_cache, logits_to_keep=1), median of {a.repeat} after a "
             f"warm-up. Decode: generate() from a {PROMPT}-token prompt, {a.new_tokens} new tokens greedy, new "
             f"tokens / wall time of the whole call, median of {a.repeat}. x fp32: tokens/s over fp32's (above 1: "
             "faster). Peak RSS run: while timing; all: the whole subprocess (fp32 model before quantizing "
             "included).", "", markdown(head, body), *goals(rows, fp, ta, phases)]
    return "\n".join(lines)


def goals(rows, fp, ta, phases) -> list[str]:
    """Issue 16's goals for the 4-bit variants on the 1B model: decode >= 2x fp32, prefill >= 1x fp32,
    and no slower than torchao's int4 CPU path in either phase."""
    out = []
    for r in rows:
        if r["model"] != "llama1b" or "error" in r or not re.match(r"(int4|hqq4|awq4|gptq4)", r["variant"]):
            continue
        checks = []
        if r["model"] in fp:
            base = fp[r["model"]]
            checks.append(f"decode x fp32 {r['decode'] / base['decode']:.2f} (goal >= 2)")
            checks += [f"{p} x fp32 {r[p] / base[p]:.2f} (goal >= 1)" for p in phases[:-1]]
        if r["model"] in ta:
            checks += [f"{p} x torchao {r[p] / ta[r['model']][p]:.2f} (goal >= 1)" for p in phases]
        if checks:
            out.append(f"- {r['model']} {r['variant']}: " + "; ".join(checks))
    return ["", "Goals (issue 16):", *out] if out else []


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each run (default: torch's)")
    ap.add_argument("--models", default=None, help=f"comma-separated, from {','.join(MODELS)} (default: all; "
                                                   "--quick: llama1b)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated name[@fp32|@bf16]")
    ap.add_argument("--repeat", type=int, default=None, help="timed repeats per phase, median (default 3; quick 1)")
    ap.add_argument("--prefill", default=None, help="prefill lengths (default 512,2048; quick 32,64)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode tokens (default 128; quick 8)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per (model, variant) run (default: none)")
    ap.add_argument("--out", default=None, help="write the markdown table here (and the JSON beside it)")
    ap.add_argument("--quick", action="store_true", help="tiny random Llama, short lengths: a smoke run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.repeat = a.repeat or (1 if a.quick else 3)
    a.new_tokens = a.new_tokens or (8 if a.quick else 128)
    try:
        a.prefill = tuple(int(t) for t in (a.prefill or ("32,64" if a.quick else "512,2048")).split(","))
    except ValueError:
        ap.error(f"--prefill must be comma-separated integers, got {a.prefill!r}")
    if a.repeat < 1 or a.new_tokens < 1 or min(a.prefill) < 1 or (a.threads is not None and a.threads < 1):
        ap.error("--repeat, --new-tokens, --prefill and --threads must be positive")
    if a.worker:
        return worker(a)
    models = (a.models or ("llama1b" if a.quick else ",".join(MODELS))).split(",")
    variants = a.variants.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"--models: unknown {bad}; choose from {', '.join(MODELS)}")
    try:
        for v in variants:
            parse_variant(v)
    except ValueError as e:
        ap.error(str(e))
    info, load = machine(), {"before": os.getloadavg()}
    rows = []
    for m in models:
        for v in variants:
            print(f"[{time.strftime('%H:%M:%S')}] {m} {v} ...", flush=True)
            rows.append(run_one(a, m, v))
            r = rows[-1]
            print("   ", r.get("error") or {k: round(r[k], 2) for k in ("prefill_" + str(a.prefill[0]), "decode",
                                                                      "peak_rss_run_gb", "wall_s")}, flush=True)
    load["after"] = os.getloadavg()
    text = table(rows, a, info, load)
    payload = {"machine": info, "load": load, "rows": rows, "settings": {
        "repeat": a.repeat, "prefill": a.prefill, "new_tokens": a.new_tokens, "prompt": PROMPT, "quick": a.quick}}
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    elif not a.quick:
        results = Path(__file__).parent / "results"
        results.mkdir(exist_ok=True)
        (results / "e2e.md").write_text(text + "\n")
        (results / "e2e.json").write_text(json.dumps(payload, indent=2) + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
