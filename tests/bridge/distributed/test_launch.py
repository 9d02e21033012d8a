"""``qtransform quantize`` on several processes, for real (gloo on 127.0.0.1): ``--nproc 2`` (torchrun on one
machine), two torchrun "nodes" on loopback, and a rank failing in the middle of the collectives. The
one-process run (in this process) is the reference: the N-process checkpoint is the same bytes, its
perplexities the same numbers; rank 0 alone writes and speaks. Every subprocess has a timeout (its whole
process group is killed then), so a hang fails the test instead of blocking the run."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bridge.app.cli import main
from bridge.distributed import launch

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 180  # seconds for any launch (a run takes ~20 s on a busy 2-core machine)
ARGS = ["--in-memory", "--recipe", "gptq4-g64", "--calib", "8", "--calib-batch", "2", "--seq-len", "32", "--eval-sequences", "8",
        "--dist-timeout", "60"]
LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID")

# node 1's plugin: its rank fails in GPTQ's second block, while rank 0 waits in that block's collectives
FAIL_IN_SECOND_BLOCK = """
import bridge.calibrate.blocks as blocks

real, calls = blocks.fit_block_on, []


def fit_block_on(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        raise RuntimeError("injected failure in the second block")
    return real(*args, **kwargs)


blocks.fit_block_on = fit_block_on
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    path = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(path), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               OMP_NUM_THREADS="1")
    return env


def _run_all(cmds: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Start every command at once (each in its own session), wait for all; past TIMEOUT kill them all."""
    procs = [subprocess.Popen(c, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for c in cmds]
    results = []
    try:
        for c, p in zip(cmds, procs):
            out, err = p.communicate(timeout=TIMEOUT)
            results.append(subprocess.CompletedProcess(c, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"a launch ran past {TIMEOUT} s: {cmds}")
    return results


def _node(rank: int, port: int, model: Path, out: Path, *extra: str) -> list[str]:
    """``torchrun --nnodes 2 --node-rank RANK --nproc-per-node 1 ... --no-python python -m bridge.app.cli ...``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "--no-python",
            sys.executable, "-m", "bridge.app.cli", "quantize", "--model", str(model), "--out", str(out), *ARGS, *extra]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory):
    """The one-process run's output directory (this process: no launcher)."""
    out = tmp_path_factory.mktemp("one") / "ckpt"
    assert main(["quantize", "--model", str(tiny_llama_dir), "--out", str(out), *ARGS]) == 0
    return out


def _same_as(reference: Path, out: Path) -> None:
    files = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in out.iterdir()) == files
    for name in files:
        if name != "report.json":  # the checkpoint's tensors and metadata, the config, the tokenizer: same bytes
            assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    one, many = (json.loads((d / "report.json").read_text()) for d in (reference, out))
    for key in ("ppl_before", "ppl_after", "calib_tokens", "eval_tokens", "size_after"):
        assert many[key] == one[key], key  # perplexities shared over the ranks: exactly the one-process value
    assert one["ppl_before"] is not None and one["ppl_after"] is not None
    # the report's relative errors ||W - Ŵ||²/||W||² are float32 reductions whose rounding follows the thread
    # count (this process: torch's default; each rank: 1); the tensors they compare are the same bytes (above)
    assert [{**r, "rel_error": None} for r in many["layers"]] == [{**r, "rel_error": None} for r in one["layers"]]
    assert [r["rel_error"] for r in many["layers"]] == pytest.approx([r["rel_error"] for r in one["layers"]], rel=1e-5)


def test_nproc_2_writes_the_one_process_checkpoint_once(reference, tiny_llama_dir, tmp_path, capfd, monkeypatch):
    """``--nproc 2``: the same command under ``torchrun --standalone --nproc-per-node 2``; rank 0 alone writes
    and speaks (one report on stdout), the checkpoint is the one-process bytes."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in _env().items():
        monkeypatch.setenv(k, v)
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: real(*a, timeout=TIMEOUT, **k))
    capfd.readouterr()
    out = tmp_path / "ckpt"
    assert main(["quantize", "--nproc", "2", "--model", str(tiny_llama_dir), "--out", str(out), *ARGS]) == 0
    stdout, stderr = capfd.readouterr()
    _same_as(reference, out)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # one directory, no temporary left
    assert stdout.count("loading ") == 1 and stdout.count("checkpoint, report.json") == 1, stdout  # rank 1 quiet
    assert "qtransform: error" not in stderr


def test_two_nodes_on_loopback_give_the_one_process_checkpoint(reference, tiny_llama_dir, tmp_path):
    """Two torchrun agents (``--nnodes 2``, ``--node-rank 0/1``, the same master port), one rank each: node 0's
    rank writes its ``--out``, node 1's writes nothing (its own ``--out`` stays absent) and prints nothing."""
    port = free_port()
    n0, n1 = _run_all([_node(0, port, tiny_llama_dir, tmp_path / "n0"),
                       _node(1, port, tiny_llama_dir, tmp_path / "n1")])
    assert n0.returncode == 0 and n1.returncode == 0, (n0.stderr[-2000:], n1.stderr[-2000:])
    _same_as(reference, tmp_path / "n0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n0"]
    assert "checkpoint, report.json" in n0.stdout and n1.stdout == ""
    assert "qtransform:" not in n1.stderr  # neither warnings nor errors from rank 1


def test_a_rank_failing_mid_collectives_stops_both_and_writes_nothing(tiny_llama_dir, tmp_path):
    """Node 1's rank fails inside GPTQ's second block while rank 0 waits for it in a collective: both exit
    non-zero promptly (not after --dist-timeout), node 1 with its own message naming its rank, node 0 saying
    that another rank failed; nothing appears at --out, no temporary directory is left."""
    plugin = tmp_path / "fail.py"
    plugin.write_text(FAIL_IN_SECOND_BLOCK)
    port = free_port()
    out = tmp_path / "ckpt"
    n0, n1 = _run_all([_node(0, port, tiny_llama_dir, out), _node(1, port, tiny_llama_dir, out, "--plugin", str(plugin))])
    assert n0.returncode != 0 and n1.returncode != 0
    assert "qtransform: error: rank 1: RuntimeError: injected failure in the second block" in n1.stderr, n1.stderr[-2000:]
    assert "qtransform: error: rank 0: stopped: another rank failed" in n0.stderr, n0.stderr[-2000:]
    for node in (n0, n1):  # each worker exited by itself with status 1 (no abort, no signal from its agent)
        assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", node.stderr)) == {"1"}, node.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fail.py"]


STAGES = """
import importlib.util, sys

spec = importlib.util.spec_from_file_location("launch", sys.argv[1])  # torch only: no bridge import, fast
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
env = launch.init(timeout=30)  # from RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, as torchrun sets them
assert (launch.world(), launch.rank(), launch.is_main()) == (2, env.rank, env.rank == 0)
with launch.stage():
    pass
print(launch.where() + "passed the first stage", flush=True)
try:
    with launch.stage():
        if launch.rank() == 1:
            raise ValueError("--calib file missing on this machine")
except launch.RankFailed as e:
    print(launch.where() + "RankFailed: " + str(e), flush=True)
    launch.teardown(failed=True)
    sys.exit(1)
except ValueError as e:
    print(launch.where() + "ValueError: " + str(e), flush=True)
    launch.teardown(failed=True)
    sys.exit(1)
print("passed the second stage", flush=True)
"""


def test_a_rank_failing_in_a_stage_stops_every_rank_with_its_message(tmp_path):
    """The ranks agree at the end of a stage (the command's checks, its loading): a rank failing there
    (an input missing on its machine) stops every rank with that rank's message, none left waiting. Two real
    processes in a gloo group from torchrun's variables, running :mod:`bridge.distributed.launch` alone."""
    port, env = free_port(), _env()
    cmds = [[sys.executable, "-c", STAGES, str(ROOT / "bridge" / "distributed" / "launch.py")] for _ in range(2)]
    procs = [subprocess.Popen(c, env=dict(env, WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=str(port)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for r, c in enumerate(cmds)]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [1, 1], outs
    assert outs[0][0].splitlines() == ["rank 0: passed the first stage",
                                       "rank 0: RankFailed: stopped: rank 1 failed: --calib file missing on this machine"]
    assert outs[1][0].splitlines() == ["rank 1: passed the first stage",
                                       "rank 1: ValueError: --calib file missing on this machine"]


# ------------------------------------------------------------------ without processes
def test_nproc_is_refused_under_a_launcher(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["quantize", "--nproc", "2", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "o")]) == 1
    assert "--nproc starts torchrun itself, but this process already runs under a launcher" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="already runs under a launcher"):
        launch.relaunch(["quantize"], 2, environ={"TORCHELASTIC_RUN_ID": "x"})


def test_the_environment_is_read_and_checked():
    assert launch.from_env({"WORLD_SIZE": "1"}) == launch.Env(1, 0, 0, True)
    assert launch.from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == launch.Env(4, 3, 1, True)
    with pytest.raises(ValueError, match="RANK is not set"):
        launch.from_env({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two': not an integer"):
        launch.from_env({"WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        launch.init(timeout=float("inf"), environ={})
    if not torch.cuda.is_available():  # NCCL wants one GPU per rank: refused before any group is made
        two = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
        with pytest.raises(ValueError, match="local rank 1 of its machine, which has 0 CUDA device"):
            launch.init("cuda", environ=two)
    # one process: nothing initialised, the one-process answers
    assert launch.init(environ={"WORLD_SIZE": "1"}).world == 1
    assert (launch.world(), launch.rank(), launch.is_main(), launch.where()) == (1, 0, True, "")
    with launch.stage():  # no collective in one process
        pass


def test_threads_and_the_nproc_option_are_handled():
    assert launch.threads_per_rank(2, cores=16) == 8 and launch.threads_per_rank(4, cores=2) == 1
    assert launch.strip_option(["quantize", "--nproc", "2", "--model", "m"], "--nproc") == ["quantize", "--model", "m"]
    assert launch.strip_option(["--nproc=2", "--no-eval"], "--nproc") == ["--no-eval"]
