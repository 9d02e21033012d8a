"""The main job's own time: `qtransform quantize` end to end on the default SmolLM2-135M, phase by phase.

Each run is a fresh process, as a user runs the command (`python -m bridge.app.cli quantize --recipe R
--no-eval --out DIR --overwrite`); its wall time is measured here and split with the phases the
command writes in report.json (``phases``: check, load, quantize = the step itself, report, modules,
write) and ``startup`` = wall - the command's own total (Python, torch and transformers imports).
Rows (medians of ``--repeat`` runs, interleaved):

* ``RECIPE`` with the default model's converted-once cache warm (bridge/app/model_cache.py);
* ``RECIPE, first run`` into an empty cache (the conversion of the GGUF file: once per machine);
* ``RECIPE, no cache`` with ``QTRANSFORM_NO_CACHE=1`` (the GGUF file read by transformers each time:
  what every run cost before the cache);
* ``hqq (peer)``: hqq's own end to end (bench/peer_hqq_e2e.py: load the same float model from the
  cache's transformers directory, `AutoHQQHFModel.quantize_model` 4 bits g64, `save_quantized`), beside
  ``hqq4-g64``, the same scheme from our command.

Run: ``python bench/bench_cli.py [--repeat 3] [--recipes int4-g128,hqq4-g64] [--no-peer]``; writes
bench/results/cli.{json,md}. State the load: timings mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import markdown, write  # noqa: E402

PHASES = ("startup", "check", "load", "quantize", "report", "modules", "write")


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env.pop("QTRANSFORM_NO_CACHE", None)
    return {**env, **extra}


def run_ours(recipe: str, env: dict) -> dict:
    """One fresh `qtransform quantize` process: wall seconds and the report's phases."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "bridge.app.cli", "quantize", "--recipe", recipe, "--no-eval", "--out", str(out)]
        t = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=ROOT)
        wall = time.perf_counter() - t
        rep = json.loads((out / "report.json").read_text())
    phases = {"startup": wall - rep["seconds_total"], **rep.get("phases", {})}
    return {"wall": wall, **phases}


def run_peer(model_dir: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "peer_hqq_e2e.py"), str(model_dir), tmp],
                              env=_env(), check=True, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall": wall, "startup": phases.pop("import"), **phases}


def median_row(runs: list[dict]) -> dict:
    keys = sorted({k for r in runs for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def cached_model_dir(env: dict) -> Path:
    code = ("from bridge.app import models; s = models.resolve(None); models.load_tokenizer(s); "
            "print(models.cached_directory(s))")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True, cwd=ROOT)
    return Path(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--recipes", default="int4-g128,hqq4-g64")
    ap.add_argument("--no-peer", action="store_true", help="skip hqq's own end to end")
    ap.add_argument("--no-cold", action="store_true", help="skip the first-run and no-cache rows")
    a = ap.parse_args()
    recipes = a.recipes.split(",")
    load_before = os.getloadavg()
    warm = _env()
    model_dir = cached_model_dir(warm)  # converts once if needed: the cache is warm from here on
    rows = {}
    for recipe in recipes:
        rows[recipe] = [run_ours(recipe, warm) for _ in range(a.repeat)]
    if not a.no_peer:
        rows["hqq (peer)"] = [run_peer(model_dir) for _ in range(a.repeat)]
    if not a.no_cold:
        first = recipes[0]
        with tempfile.TemporaryDirectory() as cache:
            rows[f"{first}, first run"] = [run_ours(first, _env(QTRANSFORM_CACHE_DIR=cache))]
        rows[f"{first}, no cache"] = [run_ours(first, _env(QTRANSFORM_NO_CACHE="1"))]
    load_after = os.getloadavg()
    out_rows, table = [], []
    for name, runs in rows.items():
        m = median_row(runs)
        step = m.get("quantize", 0.0)
        outside = m["wall"] - step
        out_rows.append({"scheme": name, "runs": len(runs), **{k: round(v, 3) for k, v in m.items()},
                         "outside_step": round(outside, 3)})
        table.append([name, len(runs), f"{m['wall']:.2f}"] + [f"{m.get(p, 0.0):.2f}" for p in PHASES]
                     + [f"{m.get('save', 0.0):.2f}" if "save" in m else "-", f"{outside:.2f} ({outside / m['wall']:.0%})"])
    md = (f"`qtransform quantize --no-eval` on SmolLM2-135M-Instruct, fresh process per run, medians; seconds. "
          f"torch threads: default; load average before {tuple(round(x, 2) for x in load_before)}, "
          f"after {tuple(round(x, 2) for x in load_after)}.\n\n"
          + markdown(["run", "n", "wall", *PHASES, "save (peer)", "outside the step"], table))
    write("cli", out_rows, md, {"load_before": load_before, "load_after": load_after})


if __name__ == "__main__":
    main()
