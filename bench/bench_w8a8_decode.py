"""Whole-model decode of SmolLM2-135M: W8A8 int8 with dynamic per-token inputs against fp32, side by side.

One process loads SmolLM2-135M-Instruct once (``bridge.app.models.load_causal_lm``, offline, fp32) and
quantizes deep copies with the ``w8a8-int8-dynamic`` preset (``lm_head`` stays float):

* ``fp32``: the float model;
* ``w8a8 fused``: the automatic kernel choice (``int8_dynamic_cpu``: the fused per-token quantizer and
  the int8 GEMV, :mod:`bridge.kernels.int8dyn`);
* ``w8a8 general``: the path before it, for comparison: ``int8pack_cpu`` forced and the input
  quantizer through the general ``choose_qparams`` / ``fake_quantize`` (the fused quantizer turned off).

Decode: a 32-token prompt through the KV cache, then ``--steps`` single-token forwards, greedy (the argmax
of the last logits fed back); tokens/s = steps / their wall time (the prompt not counted). For each thread
count (1 and 2) the variants run interleaved, ``--repeat`` times, median (``w8a8 general`` at 1 thread only). Then one profile per variant
(at 1 thread): the time per step spent inside the linear layers (forward hooks around each ``nn.Linear`` /
``QLinear``, ``lm_head`` included) and outside them (attention, norms, rotary, embedding, Python).

    python bench/bench_w8a8_decode.py [--steps N] [--repeat R]

Writes bench/results/w8a8_decode.json and bench/results/w8a8_decode.md; the load average before and
after is recorded (the machine is shared).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bridge/ next to qtransform/

import bridge  # noqa: E402
import qtransform as qt  # noqa: E402
from bridge.app import models  # noqa: E402
from bridge.modules import actquant  # noqa: E402
from common import kernels_used, markdown, write  # noqa: E402

PROMPT = 32
PRESET = "w8a8-int8-dynamic"


def variants(fp32: torch.nn.Module) -> dict[str, torch.nn.Module]:
    fused = bridge.quantize(copy.deepcopy(fp32), qt.get_preset(PRESET).recipe, inplace=True)
    general = bridge.quantize(copy.deepcopy(fp32), qt.get_preset(PRESET).recipe, inplace=True)
    for m in general.modules():
        if isinstance(m, bridge.QLinear):
            m.kernel = "int8pack_cpu"
    return {"fp32": fp32, "w8a8 fused": fused, "w8a8 general": general}


class _General:
    """The general activation-quantizer path while active (the fused one turned off)."""

    def __enter__(self):
        self.saved = actquant._fused
        actquant._fused = lambda *a, **k: False

    def __exit__(self, *exc):
        actquant._fused = self.saved


def _context(name: str):
    return _General() if name == "w8a8 general" else contextlib.nullcontext()


def decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> float:
    """Seconds for ``steps`` single-token forwards after the prompt (greedy, KV cache)."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(steps):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t


def profile(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> dict:
    """ms per step inside the linear layers and in total (hooks around every linear)."""
    spent = [0.0]
    start = {}

    def pre(mod, args):
        start[id(mod)] = time.perf_counter()

    def post(mod, args, out):
        spent[0] += time.perf_counter() - start.pop(id(mod))

    hooks = []
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, bridge.QLinear)):
            hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        decode(model, prompt, 2)
        spent[0] = 0.0
        total = decode(model, prompt, steps)
        # the prompt's linears are in spent too: take them out with a zero-step run
        spent_steps = spent[0]
        spent[0] = 0.0
        decode(model, prompt, 0)
        spent_steps -= spent[0]
    finally:
        for h in hooks:
            h.remove()
    return {"step_ms": 1e3 * total / steps, "linear_ms": 1e3 * spent_steps / steps}


def run(steps: int, repeat: int) -> tuple[list[dict], dict, dict]:
    load = {"load_before": os.getloadavg()}
    fp32 = models.load_causal_lm()
    mods = variants(fp32)
    kernels = {name: kernels_used(m) for name, m in mods.items()}
    prompt = torch.randint(0, fp32.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        run_mods = {n: m for n, m in mods.items() if threads == 1 or n != "w8a8 general"}  # (slow: 1 thread only)
        times = {name: [] for name in run_mods}
        for name, m in run_mods.items():  # warm-up
            with _context(name):
                decode(m, prompt, 2)
        for _ in range(repeat):
            for name, m in run_mods.items():
                with _context(name):
                    times[name].append(decode(m, prompt, steps))
        base = steps / statistics.median(times["fp32"])
        for name in run_mods:
            tps = steps / statistics.median(times[name])
            rows.append({"threads": threads, "variant": name, "kernels": kernels[name], "decode_tok_s": round(tps, 2),
                         "x_fp32": round(tps / base, 3), "all_tok_s": [round(steps / t, 2) for t in times[name]]})
    torch.set_num_threads(1)
    prof = {}
    for name, m in mods.items():
        with _context(name):
            prof[name] = profile(m, prompt, steps)
    load["load_after"] = os.getloadavg()
    return rows, prof, load


def table(rows: list[dict], prof: dict, load: dict, steps: int, repeat: int) -> str:
    caps = torch.backends.cpu.get_cpu_capability()
    head = (f"SmolLM2-135M-Instruct decode, torch {torch.__version__}, CPU capability {caps}, "
            f"{os.cpu_count()} logical cores; load average before {tuple(round(v, 2) for v in load['load_before'])}, "
            f"after {tuple(round(v, 2) for v in load['load_after'])}. A {PROMPT}-token prompt, then {steps} "
            f"single-token steps (greedy, KV cache), tokens/s of the steps, median of {repeat} interleaved runs.\n\n")
    body = markdown(["threads", "variant", "kernel(s)", "decode tok/s", "x fp32", "runs tok/s"],
                    [[r["threads"], r["variant"], r["kernels"], f"{r['decode_tok_s']:.2f}", f"{r['x_fp32']:.2f}",
                      ", ".join(f"{v:.1f}" for v in r["all_tok_s"])] for r in rows])
    pt = markdown(["variant", "ms per step", "in linear layers", "outside them"],
                  [[n, f"{p['step_ms']:.1f}", f"{p['linear_ms']:.1f}", f"{p['step_ms'] - p['linear_ms']:.1f}"]
                   for n, p in prof.items()])
    return head + body + "\n\nWhere a step's time goes (1 thread, forward hooks around every linear):\n\n" + pt


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64, help="decode steps per run")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs per (threads, variant), median")
    a = ap.parse_args()
    if a.steps < 1 or a.repeat < 1:
        ap.error("--steps and --repeat must be positive")
    rows, prof, load = run(a.steps, a.repeat)
    write("w8a8_decode", rows, table(rows, prof, load, a.steps, a.repeat),
          extra={"profile": prof, **load, "steps": a.steps, "repeat": a.repeat,
                 "cpu_capability": torch.backends.cpu.get_cpu_capability()})


if __name__ == "__main__":
    main()
