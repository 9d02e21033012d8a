"""Shared bench helpers: interleaved timing (median of repeats) and result files."""

from __future__ import annotations

import json
from collections import Counter
import pathlib
import platform
import statistics
import time

import torch

RESULTS = pathlib.Path(__file__).parent / "results"


def timeit(fns: dict, *, repeat: int = 7, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, run interleaved so drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def machine() -> dict:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}


def write(name: str, rows: list[dict], table: str, extra: dict | None = None) -> None:
    RESULTS.mkdir(exist_ok=True)
    payload = {"machine": machine(), "rows": rows, **(extra or {})}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(table + "\n")
    print(table)


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def merged(name: str, rows: list[dict], order: list[str]) -> list[dict]:
    """``rows`` with the schemes of an earlier run of bench ``name`` (``--only``) that this run did not
    repeat, in ``order``."""
    path = RESULTS / f"{name}.json"
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    new = {r["scheme"]: r for r in rows}
    names = [n for n in order if n in new or any(r["scheme"] == n for r in old)]
    return [new.get(n) or next(r for r in old if r["scheme"] == n) for n in names]


def quality_args(*, calib: int, description: str = "", batch: int = 4):
    """The perplexity benches' arguments: --calib, --calib-batch, --eval, --seq-len, --only."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--calib", type=int, default=calib)
    ap.add_argument("--calib-batch", type=int, default=batch, help="calibration sequences per batch")
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--only", nargs="*", default=None, help="scheme names to run (default: all)")
    return ap.parse_args()


def quality_runs(schemes: dict, a):
    """SmolLM2's float perplexity on the evaluation tokens and, for each scheme ``name -> (recipe, needs
    calibration)`` (those ``--only`` names; a recipe may be a function ``(model, calibration) -> model``),
    ``(name, perplexity, seconds to quantize)``; returns ``(float perplexity, evaluation tokens, rows)``."""
    import bridge
    from bridge.app import corpus, evaluate, models

    model, tok = models.load_with_tokenizer()
    model.eval()
    ev = corpus.token_sequences(corpus.load_text("builtin", part="eval"), tok, seq_len=a.seq_len, max_sequences=a.eval)
    cal = list(corpus.token_sequences(corpus.load_text("builtin", part="calibration"), tok, seq_len=a.seq_len,
                                      max_sequences=a.calib).split(a.calib_batch))
    with torch.no_grad():
        fp = evaluate.perplexity(model, ev).perplexity
    rows = []
    for name, (recipe, calibrated) in schemes.items():
        if a.only and name not in a.only:
            continue
        t = time.perf_counter()
        with torch.no_grad():
            data = cal if calibrated else None
            qm = recipe(model, data) if callable(recipe) else bridge.quantize(model, recipe, calibration=data,
                                                                              kernel="dequant")
            seconds = time.perf_counter() - t
            ppl = evaluate.perplexity(qm, ev).perplexity
        rows.append((name, ppl, seconds))
        print(name, round(ppl / fp, 4), round(seconds, 1), flush=True)
        del qm
    return fp, ev.numel(), rows


def kernels_used(model) -> str:
    """``"int4pack_cpu x154, F.linear float32 x1"``: the forward path of each linear layer (our modules' kernels,
    torchao's tensor kinds, plain ``F.linear`` by dtype)."""
    import bridge

    seen = Counter()
    for m in model.modules():
        if isinstance(m, bridge.QModule):
            seen[m.kernel] += 1
        elif isinstance(m, torch.nn.Linear):
            w = m.weight
            kind = type(w).__name__ if type(w) not in (torch.Tensor, torch.nn.Parameter) else None
            seen[f"torchao {kind} (_weight_int4pack_mm_for_cpu)" if kind == "Int4OpaqueTensor"
                 else kind or f"F.linear {str(w.dtype).removeprefix('torch.')}"] += 1
    return ", ".join(f"{k} x{n}" for k, n in seen.most_common())
