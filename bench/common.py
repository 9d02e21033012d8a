"""Shared bench helpers: interleaved timing (median of repeats) and result files."""

from __future__ import annotations

import json
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
