"""A streamed run killed with SIGKILL in the middle resumes with ``--resume`` and writes the bytes of a run that
never stopped; a resume whose inputs changed is refused, naming what changed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from bridge.app.cli import main

from stream_util import digests, quantize
import tiny_lm

#: a plugin that kills the command (SIGKILL: no clean-up runs) when the streamed run starts block KILL_AT
KILLER = '''
import os, signal
from bridge.stream import blocks, driver
at = int(os.environ["KILL_AT"])
real_block = blocks.BlockRun._block
def _block(self, name):
    if name.endswith(f".{at}"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_block(self, name)
blocks.BlockRun._block = _block
seen = []
real_put = driver.ShardFiles.put
def put(self, tensors):
    seen.append(1)
    if os.environ.get("KILL_AFTER_TENSORS") and len(seen) > int(os.environ["KILL_AFTER_TENSORS"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_put(self, tensors)
driver.ShardFiles.put = put
'''


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tiny_lm.WORDS) + 2, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    d = tmp_path_factory.mktemp("resume") / "src"
    LlamaForCausalLM(cfg).eval().to(torch.bfloat16).save_pretrained(d, max_shard_size="60KB")
    tiny_lm.tokenizer().save_pretrained(d)
    return d


def _killed(tmp_path, source, out, preset, *extra, **env):
    plugin = tmp_path / "killer.py"
    plugin.write_text(KILLER)
    cmd = [sys.executable, "-m", "bridge.app.cli", "quantize", "--model", str(source), "--recipe", preset, "--out",
           str(out), "--threads", "1", "--seq-len", "16", "--no-eval", "--stream", "--plugin", str(plugin), *extra]
    run = subprocess.run(cmd, env={**os.environ, "KILL_AT": "99", **env}, capture_output=True, text=True, timeout=600)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert not out.exists()
    partial = out.parent / f".{out.name}.partial"
    return json.loads((partial / "manifest.json").read_text())


CALIB = ("--calib", "4", "--calib-batch", "1")


def test_gptq_killed_at_block_3_resumes_to_the_same_bytes(source, tmp_path):
    quantize(source, tmp_path / "whole", "gptq4-g64", "--no-eval", "--stream", *CALIB)
    manifest = _killed(tmp_path, source, tmp_path / "out", "gptq4-g64", *CALIB, KILL_AT="3")
    assert {"block 0", "block 1", "block 2"} <= set(manifest["done"]) and "block 3" not in manifest["done"]
    rep = quantize(source, tmp_path / "out", "gptq4-g64", "--no-eval", "--stream", "--resume", *CALIB)
    assert digests(tmp_path / "out") == digests(tmp_path / "whole")
    assert rep["layers"] and not (tmp_path / ".out.partial").exists()


def test_shard_to_shard_killed_after_some_tensors_resumes_to_the_same_bytes(source, tmp_path):
    quantize(source, tmp_path / "whole", "int4-g64", "--no-eval", "--stream")
    _killed(tmp_path, source, tmp_path / "out", "int4-g64", KILL_AFTER_TENSORS="20")
    quantize(source, tmp_path / "out", "int4-g64", "--no-eval", "--stream", "--resume")
    assert digests(tmp_path / "out") == digests(tmp_path / "whole")


def test_a_resume_with_other_inputs_is_refused_naming_what_changed(source, tmp_path, capsys):
    _killed(tmp_path, source, tmp_path / "out", "gptq4-g64", *CALIB, KILL_AT="2")
    rc = main(["quantize", "--model", str(source), "--recipe", "gptq4-g64", "--out", str(tmp_path / "out"),
               "--seq-len", "16", "--no-eval", "--stream", "--resume", "--calib", "3", "--calib-batch", "1"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "--resume" in err and "calibration" in err and "recipe" not in err
    rc = main(["quantize", "--model", str(source), "--recipe", "gptq4-g128", "--out", str(tmp_path / "out"),
               "--seq-len", "16", "--no-eval", "--stream", "--resume", *CALIB])
    assert rc == 1 and "recipe" in capsys.readouterr().err
    assert (tmp_path / ".out.partial" / "manifest.json").is_file()  # a refused resume leaves the work as it was
    # without --resume the run starts over
    quantize(source, tmp_path / "out", "gptq4-g64", "--no-eval", "--stream", *CALIB)
    quantize(source, tmp_path / "whole", "gptq4-g64", "--no-eval", "--stream", *CALIB)
    assert digests(tmp_path / "out") == digests(tmp_path / "whole")


def test_resume_goes_with_stream(source, tmp_path, capsys):
    rc = main(["quantize", "--model", str(source), "--out", str(tmp_path / "o"), "--resume", "--no-eval", "--in-memory"])
    assert rc == 2 or rc == 1
    assert "--resume" in capsys.readouterr().err and not (tmp_path / "o").exists()
