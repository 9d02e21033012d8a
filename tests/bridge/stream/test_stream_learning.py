"""The learning step streams: ``qtransform quantize --recipe qat2-g64 --stream`` (each block's weights and ranges
trained on that block's calibration inputs, the model read block by block from its shards) writes the bytes of the
in-memory run, and a streamed run killed with SIGKILL in the middle resumes with ``--resume`` to the same bytes."""

from __future__ import annotations

import json

import pytest

from stream_util import digests, quantize, save_tiny

#: a short training (the preset's start, GPTAQ, then 4 Adam steps a block) on 4 calibration sequences
RECIPE = {"type_rules": {"Linear": "qat2-g64"}, "exclude": ["lm_head*"],
          "steps": [{"name": "qat", "options": {"iters": 4, "batch_size": 2, "init": "gptaq", "holdout": 0}}]}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("learn-src") / "llama")


@pytest.fixture()
def recipe(tmp_path):
    path = tmp_path / "qat.json"
    path.write_text(json.dumps(RECIPE))
    return str(path)


def test_streamed_qat_has_the_bytes_of_the_in_memory_run(source, recipe, tmp_path):
    extra = ("--calib", "4", "--calib-batch", "2", "--no-eval")
    memory = quantize(source, tmp_path / "memory", recipe, *extra)
    streamed = quantize(source, tmp_path / "stream", recipe, "--stream", *extra)
    assert streamed["streamed"] and not memory["streamed"]
    assert digests(tmp_path / "stream") == digests(tmp_path / "memory")


def test_qat_killed_in_the_middle_resumes_to_the_same_bytes(source, recipe, tmp_path):
    from test_stream_resume import _killed

    calib = ("--calib", "4", "--calib-batch", "2")
    quantize(source, tmp_path / "whole", recipe, "--no-eval", "--stream", *calib)
    manifest = _killed(tmp_path, source, tmp_path / "out", recipe, *calib, KILL_AT="1")
    assert "block 0" in manifest["done"] and "block 1" not in manifest["done"]
    quantize(source, tmp_path / "out", recipe, "--no-eval", "--stream", "--resume", *calib)
    assert digests(tmp_path / "out") == digests(tmp_path / "whole")
