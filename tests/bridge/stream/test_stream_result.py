"""One result type for both drivers: a streamed run returns the ``bridge.Quantized`` an in-memory run returns (the
same plan, step reports and activation quantizers), its trees empty and ``written`` saying where they went; it is
refused where a result holding its tensors is needed."""

from __future__ import annotations

import pytest
import torch

import bridge
import qtransform as qt
from bridge.stream import quantize_checkpoint
from bridge.tree import Quantized, Written

from stream_util import save_tiny

CALIB = [torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("result") / "src")


@pytest.mark.parametrize("preset", ["gptq4-g64", "w8a8-int8"])
def test_a_streamed_run_returns_the_in_memory_runs_result_without_its_trees(preset, source, tmp_path):
    from transformers import AutoModelForCausalLM

    recipe = qt.get_preset(preset).recipe
    streamed = quantize_checkpoint(source, tmp_path / "out", recipe, calibration=CALIB)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    ours = bridge.quantize_params(model, recipe, calibration=CALIB)
    assert type(streamed) is Quantized and streamed.params == {} and streamed.qtree == {}
    assert isinstance(streamed.written, Written) and ours.written is None
    assert streamed.written.directory == str(tmp_path / "out") and streamed.written.mode == "block by block"
    assert streamed.written.bytes_out == sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors"))
    assert {p: m.spec for p, m in streamed.plan.items()} == {p: m.spec for p, m in ours.plan.items()}
    assert streamed.info == ours.info  # GPTQ's losses, bit for bit
    assert streamed.activations.keys() == ours.activations.keys()
    for site, q in ours.activations.items():
        got = streamed.activations[site]
        assert (got == q) if isinstance(q, qt.QuantSpec) else torch.equal(got.scale, q.scale)


def test_a_streamed_result_is_refused_where_its_tensors_are_needed(source, tmp_path):
    from transformers import AutoModelForCausalLM

    done = quantize_checkpoint(source, tmp_path / "out", qt.get_preset("int4-g128").recipe)
    with pytest.raises(ValueError, match="holds no tensors: they are in .*out"):
        bridge.to_module(AutoModelForCausalLM.from_pretrained(source), done)
    with pytest.raises(ValueError, match="already written to .*out"):
        bridge.save(done, tmp_path / "again")
    assert not (tmp_path / "again").exists()
