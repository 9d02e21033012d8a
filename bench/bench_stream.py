"""Models larger than memory (issue 29): peak RSS and wall time of ``qtransform quantize`` streaming
(``--stream``) against the in-memory path, on random checkpoints of real shapes, and a kill-and-resume.

    .venv/bin/python bench/bench_stream.py                       # all cases (hours on 2 cores)
    .venv/bin/python bench/bench_stream.py --cases smollm2-rtn-memory smollm2-rtn-stream --skip-make

Each case runs one command under ``/usr/bin/time -v`` (its "Maximum resident set size" and "Elapsed
(wall clock) time") and records the input checkpoint's GB (its ``*.safetensors`` files) per second. A
failing command is recorded as failed with the last lines of its stderr; the other cases go on. The
checkpoints (bench/make_checkpoint.py: TinyLlama-1.1B and Llama-3-8B shapes in bf16; the default model
SmolLM2-135M-Instruct saved as a bf16 safetensors directory) are made under ``--scratch`` when missing
(``--skip-make``: never; ``--remake``: always), outputs go to ``--scratch``/out/<case>.

The ``resume`` case starts the 1.1B GPTQ ``--stream`` command, SIGKILLs it (its process group) when the
manifest (``--manifest``, default ``{parent}/.{name}.partial/manifest.json``) shows ``--kill-blocks`` completed
blocks or when half of the uninterrupted run's time has passed, reruns it with ``--resume-args``, and
compares the sha256 of every output file but report.json with the uninterrupted run (case
``gptq-1.1b-stream``, run first if its output is missing). Results: bench/results/stream.{json,md},
rows of earlier runs kept for the cases this run did not repeat.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, markdown, write

ROOT = Path(__file__).resolve().parent.parent
GPTQ = ["--recipe", "gptq4-g128", "--calib", "8", "--seq-len", "256", "--no-eval"]
AWQ = ["--recipe", "awq4-g128", "--calib", "8", "--seq-len", "256", "--no-eval"]
RTN = ["--recipe", "int4-g128", "--no-eval"]
HQQ = ["--recipe", "hqq4-g64", "--no-eval"]
# case -> (checkpoint, qtransform quantize arguments, streaming)
CASES = {
    "rtn-8b-stream": ("llama-3-8b", RTN, True),
    "hqq-8b-stream": ("llama-3-8b", HQQ, True),
    "gptq-1.1b-stream": ("tinyllama-1.1b", GPTQ, True),
    "gptq-1.1b-memory": ("tinyllama-1.1b", GPTQ, False),
    "awq-1.1b-stream": ("tinyllama-1.1b", AWQ, True),
    "smollm2-rtn-stream": ("smollm2-135m-bf16", RTN, True),
    "smollm2-rtn-memory": ("smollm2-135m-bf16", RTN, False),
    "smollm2-gptq-stream": ("smollm2-135m-bf16", GPTQ, True),
    "smollm2-gptq-memory": ("smollm2-135m-bf16", GPTQ, False),
    "resume": ("tinyllama-1.1b", GPTQ, True),
}
PAIRS = [("gptq-1.1b-stream", "gptq-1.1b-memory"), ("smollm2-rtn-stream", "smollm2-rtn-memory"),
         ("smollm2-gptq-stream", "smollm2-gptq-memory")]
MAKE = {"tinyllama-1.1b": ["--max-shard-size", "2GB"], "llama-3-8b": ["--max-shard-size", "5GB"]}


def env() -> dict:
    """The subprocesses' environment: this tree's code first on the path, offline."""
    e = dict(os.environ, HF_HUB_OFFLINE="1")
    e["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), e.get("PYTHONPATH", "")] if p)
    return e


def parse_time(text: str) -> dict:
    """Peak RSS (GB) and wall seconds from ``/usr/bin/time -v``'s report (None where absent)."""
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    seconds = None
    if wall:
        seconds = 0.0
        for part in wall.group(1).split(":"):
            seconds = seconds * 60 + float(part)
    return {"peak_rss_gb": round(int(rss.group(1)) * 1024 / 1e9, 3) if rss else None,
            "wall_s": round(seconds, 1) if seconds is not None else None}


def timed(cmd: list[str], log: Path, *, timeout: float) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``; its rc, peak RSS, wall time, loads and stderr's tail."""
    load0 = os.getloadavg()[0]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, env=env(),
                                cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log.read_text(errors="replace")
    body = text.split("\tCommand being timed:")[0].rstrip().splitlines()
    return {"rc": rc, **parse_time(text), "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2),
            "tail": [ln[-300:] for ln in body[-8:]], "log": str(log)}


def size_gb(directory: Path) -> float:
    return round(sum(p.stat().st_size for p in directory.glob("*.safetensors")) / 1e9, 3)


def make_smollm2(out: Path) -> None:
    """The default model (its GGUF file dequantized) as a bf16 safetensors directory with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from bridge.app import models

    model, tok = models.load_with_tokenizer(None)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # transformers' GGUF marker: such a model refuses save_pretrained
    config = AutoConfig.for_model(**{**config, "dtype": "bfloat16"})
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, assign=True)
    plain.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.replace(out)


def make(name: str, scratch: Path, a) -> dict | None:
    """Make checkpoint ``name`` under ``scratch`` unless it is there (a row timing it, or None)."""
    out = scratch / name
    if a.skip_make or ((out / "config.json").is_file() and not a.remake):
        return None
    shutil.rmtree(out, ignore_errors=True)
    if name == "smollm2-135m-bf16":
        cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); "
               f"import bench_stream, pathlib; bench_stream.make_smollm2(pathlib.Path({str(out)!r}))"]
    else:
        cmd = [sys.executable, str(ROOT / "bench" / "make_checkpoint.py"), "--shape", name, "--out", str(out),
               *MAKE[name]]
    r = timed(cmd, scratch / "logs" / f"make-{name}.log", timeout=a.timeout)
    row = {"case": f"make {name}", "command": " ".join(cmd), **r}
    row["input_gb"] = size_gb(out) if out.is_dir() else None
    row["status"] = "ok" if r["rc"] == 0 else "failed"
    print(json.dumps({k: row[k] for k in ("case", "status", "peak_rss_gb", "wall_s")}), flush=True)
    return row


def command(case: str, scratch: Path, a, *, out: Path | None = None) -> list[str]:
    checkpoint, args, stream = CASES[case]
    cmd = [a.qtransform, "quantize", "--model", str(scratch / checkpoint), *args,
           "--out", str(out or scratch / "out" / case), "--overwrite"]
    cmd.append("--stream" if stream else "--in-memory")  # a checkpoint directory streams unless told otherwise
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    return cmd


def finish(row: dict, scratch: Path) -> dict:
    """Status, input GB and GB/s of a row from :func:`timed`."""
    row["input_gb"] = size_gb(scratch / CASES[row["case"]][0])
    row["status"] = "ok" if row["rc"] == 0 else "failed"
    wall = row.get("wall_s")
    row["gb_per_s"] = round(row["input_gb"] / wall, 4) if row["status"] == "ok" and wall else None
    print(json.dumps({k: row.get(k) for k in ("case", "status", "peak_rss_gb", "wall_s", "gb_per_s")}), flush=True)
    if row["status"] != "ok":
        print("\n".join(row["tail"]), flush=True)
    return row


def run_case(case: str, scratch: Path, a) -> dict:
    cmd = command(case, scratch, a)
    r = timed(cmd, scratch / "logs" / f"{case}.log", timeout=a.timeout)
    return finish({"case": case, "command": " ".join(cmd), **r}, scratch)


def digests(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory`` (relative path -> hex) but report.json."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != "report.json":
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            out[str(p.relative_to(directory))] = h.hexdigest()
    return out


def completed_blocks(path: Path) -> int:
    """Blocks a streamed run's manifest (bridge.stream.workdir) records as done."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    done = data.get("done", []) if isinstance(data, dict) else []
    return sum(1 for u in done if isinstance(u, str) and u.startswith("block "))


def run_resume(scratch: Path, a, rows: dict) -> list[dict]:
    """Kill the 1.1B GPTQ ``--stream`` run midway, resume it, compare bytes with an uninterrupted run."""
    extra = []
    ref = scratch / "out" / "gptq-1.1b-stream"
    if "gptq-1.1b-stream" not in rows and not (ref / "config.json").is_file():
        rows["gptq-1.1b-stream"] = run_case("gptq-1.1b-stream", scratch, a)
    ref_row = rows.get("gptq-1.1b-stream", {})
    expected = ref_row.get("wall_s") if ref_row.get("status") == "ok" else None
    kill_after = (expected or a.expected_s) / 2
    out = scratch / "out" / "resume"
    manifest = Path(a.manifest.format(out=out, parent=out.parent, name=out.name))
    for d in (out, manifest.parent):  # a fresh start: no state of an earlier run
        shutil.rmtree(d, ignore_errors=True)
    cmd = command("resume", scratch, a, out=out)
    log = scratch / "logs" / "resume-killed.log"
    row = {"case": "resume", "command": " ".join(cmd), "load_before": round(os.getloadavg()[0], 2)}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), cwd=ROOT, start_new_session=True)
        blocks = 0
        while proc.poll() is None:
            blocks = completed_blocks(manifest)
            if blocks >= a.kill_blocks or time.perf_counter() - t0 >= kill_after:
                os.killpg(proc.pid, signal.SIGKILL)  # the process group this harness started
                proc.wait()
                break
            time.sleep(1.0)
    row["killed_after_s"] = round(time.perf_counter() - t0, 1)
    row["blocks_at_kill"] = blocks
    if proc.returncode != -signal.SIGKILL:
        tail = log.read_text(errors="replace").splitlines()[-8:]
        row.update(rc=proc.returncode, status="failed", tail=tail, load_after=round(os.getloadavg()[0], 2),
                   notes=f"the first run ended (rc {proc.returncode}) before it was killed")
        return [finish_plain(row)]
    resume_cmd = [c for c in cmd if c != "--overwrite"] + a.resume_args.split()
    r = timed(resume_cmd, scratch / "logs" / "resume.log", timeout=a.timeout)
    row.update(r, command=" ".join(resume_cmd))
    row = finish(row, scratch)
    if row["status"] == "ok":
        if not (ref / "config.json").is_file():
            row["identical"], row["notes"] = None, "no uninterrupted output to compare with"
        else:
            mine, theirs = digests(out), digests(ref)
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            row["identical"] = not diff
            row["differing_files"] = diff[:20]
            if diff:
                row["status"] = "failed"
    extra.append(row)
    return extra


def finish_plain(row: dict) -> dict:
    print(json.dumps({k: row.get(k) for k in ("case", "status", "notes")}), flush=True)
    return row


def notes(row: dict, by_case: dict) -> str:
    parts = [] if row.get("status") == "ok" else ["FAILED: " + " / ".join(row.get("tail", [])[-2:])[-200:]]
    for stream, memory in PAIRS:
        s, m = by_case.get(stream), by_case.get(memory)
        if row["case"] == stream and s and m and s.get("status") == m.get("status") == "ok":
            parts.append(f"time {s['wall_s'] / m['wall_s']:.2f}x, RSS {s['peak_rss_gb'] / m['peak_rss_gb']:.2f}x "
                         "of in memory")
    if row["case"] == "resume" and "killed_after_s" in row:
        parts.append(f"killed at {row['killed_after_s']} s ({row.get('blocks_at_kill')} blocks done)")
    if "identical" in row:
        parts.append(f"identical bytes to the uninterrupted run: {row['identical']}"
                     + (f" (differ: {', '.join(row['differing_files'][:3])})" if row.get("differing_files") else ""))
    if row.get("notes"):
        parts.append(row["notes"])
    if "load_before" in row:
        parts.append(f"load {row.get('load_before')}->{row.get('load_after')}")
    return "; ".join(parts)


def table(rows: list[dict]) -> str:
    by_case = {r["case"]: r for r in rows}
    body = [[r["case"], r.get("peak_rss_gb") if r.get("peak_rss_gb") is not None else "-",
             r.get("wall_s") if r.get("wall_s") is not None else "-",
             r.get("gb_per_s") if r.get("gb_per_s") is not None else "-", notes(r, by_case)] for r in rows]
    return markdown(["case", "peak RSS GB", "wall s", "input GB/s", "notes"], body)


def merge(rows: list[dict]) -> list[dict]:
    """``rows`` and those rows of bench/results/stream.json whose case this run did not repeat."""
    path = RESULTS / "stream.json"
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    new = {r["case"] for r in rows}
    order = [f"make {n}" for n in ("smollm2-135m-bf16", "tinyllama-1.1b", "llama-3-8b")] + list(CASES)
    merged = [r for r in old if r["case"] not in new] + rows
    return sorted(merged, key=lambda r: order.index(r["case"]) if r["case"] in order else len(order))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--scratch", default="/work/scratch", help="checkpoints, outputs and logs")
    ap.add_argument("--skip-make", action="store_true", help="never make checkpoints (reuse those in --scratch)")
    ap.add_argument("--remake", action="store_true", help="make the checkpoints again even if present")
    ap.add_argument("--qtransform", default=str(Path(sys.executable).parent / "qtransform"))
    ap.add_argument("--threads", type=int, default=None, help="passed to qtransform quantize --threads")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per command")
    ap.add_argument("--manifest", default="{parent}/.{name}.partial/manifest.json",
                    help="resume: the manifest polled for completed blocks ({parent}/{name}: the output directory's)")
    ap.add_argument("--kill-blocks", type=int, default=10, help="resume: kill once this many blocks are done")
    ap.add_argument("--expected-s", type=float, default=600.0,
                    help="resume: the uninterrupted run's seconds when unknown (killed at half of it)")
    ap.add_argument("--resume-args", default="--resume", help="resume: arguments replacing --overwrite")
    a = ap.parse_args(argv)
    scratch = Path(a.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    if a.skip_make and a.remake:
        raise ValueError("--skip-make and --remake: choose one")
    rows = {}
    needed = [c for c in ("smollm2-135m-bf16", "tinyllama-1.1b", "llama-3-8b")
              if any(CASES[case][0] == c for case in a.cases)]
    for name in needed:
        row = make(name, scratch, a)
        if row is not None:
            rows[row["case"]] = row
    for case in a.cases:
        if case == "resume":
            for row in run_resume(scratch, a, rows):
                rows[row["case"]] = row
        else:
            rows[case] = run_case(case, scratch, a)
        all_rows = merge(list(rows.values()))
        write("stream", all_rows, table(all_rows), extra={"scratch": str(scratch)})


if __name__ == "__main__":
    main()
