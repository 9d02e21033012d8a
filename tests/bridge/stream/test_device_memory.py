"""``qtransform quantize --device`` without ``--stream``: the whole model quantized on the device and the
checkpoint written from the host, in the format of a run without ``--device``."""

from __future__ import annotations

import json

import pytest
import torch

from stream_util import digests, quantize, save_tiny

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (make test-gpu on a GPU machine)")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("device") / "src")


def test_device_cpu_in_memory_writes_the_bytes_of_a_run_without_it(source, tmp_path):
    quantize(source, tmp_path / "plain", "gptq4-g64", "--calib", "2", "--no-eval")
    quantize(source, tmp_path / "cpu", "gptq4-g64", "--calib", "2", "--no-eval", "--device", "cpu")
    assert digests(tmp_path / "plain") == digests(tmp_path / "cpu")


def test_a_bad_device_is_refused_before_loading(source, tmp_path):
    from bridge.app.cli import main

    assert main(["quantize", "--model", str(source), "--recipe", "int4-g64", "--out", str(tmp_path / "x"),
                 "--device", "nope"]) != 0
    assert not (tmp_path / "x").exists()


@cuda
@pytest.mark.cuda
def test_device_cuda_in_memory_writes_the_format_of_a_cpu_run(source, tmp_path):
    quantize(source, tmp_path / "gpu", "gptq4-g64", "--calib", "2", "--no-eval", "--device", "cuda")
    quantize(source, tmp_path / "cpu", "gptq4-g64", "--calib", "2", "--no-eval")
    from safetensors import safe_open

    a, b = digests(tmp_path / "gpu"), digests(tmp_path / "cpu")
    assert a.keys() == b.keys() and a["config.json"] == b["config.json"]
    names = sorted(p.name for p in (tmp_path / "cpu").glob("*.safetensors"))
    assert names
    for n in names:
        with safe_open(tmp_path / "gpu" / n, "pt") as g, safe_open(tmp_path / "cpu" / n, "pt") as c:
            assert set(g.keys()) == set(c.keys())
            for k in c.keys():
                x, y = g.get_tensor(k), c.get_tensor(k)
                assert x.dtype == y.dtype and x.shape == y.shape and x.device.type == "cpu", k


@cuda
@pytest.mark.cuda
def test_device_cuda_in_memory_measures_the_perplexities_there(source, tmp_path):
    rep = quantize(source, tmp_path / "gpu", "int4-g64", "--device", "cuda")
    ref = quantize(source, tmp_path / "cpu", "int4-g64")
    # the float model in float32 on both: logits within float32 noise; the quantized model's CUDA kernel may
    # compute in bfloat16 (2**-8 relative per logit): its perplexity within 2%
    assert rep["ppl_before"] == pytest.approx(ref["ppl_before"], rel=1e-4)
    assert rep["ppl_after"] == pytest.approx(ref["ppl_after"], rel=2e-2)
    assert json.loads((tmp_path / "gpu" / "report.json").read_text())["recipe"] == "int4-g64"


def test_to_host_keeps_the_params_leaves_identical():
    import bridge
    import qtransform as qt
    from bridge.app.placement import to_host

    from bridge_util import tiny_causal_lm

    model = tiny_causal_lm("llama").eval()
    result = bridge.quantize_params(model, qt.get_preset("int4-g64").recipe)
    moved = to_host(result)
    assert moved.changed().keys() == result.changed().keys()
    assert all(moved.params[p] is t for p, t in result.params.items())
    for p, v in result.qtree.items():  # a QTensor is rebuilt around the very same tensors
        assert (moved.qtree[p].codes is v.codes) if isinstance(v, qt.QTensor) else (moved.qtree[p] is v), p


def test_to_host_takes_the_hosts_tensors_for_the_params():
    import bridge
    import qtransform as qt
    from bridge.app.placement import to_host
    from bridge.tree import extract

    from bridge_util import tiny_causal_lm

    model = tiny_causal_lm("llama").eval()
    result = bridge.quantize_params(model, qt.get_preset("int4-g64").recipe)
    host = {p: t.clone() for p, t in extract(model).items()}  # as if the model had come back from a device
    moved = to_host(result, host=host)
    assert all(moved.params[p] is host[p] for p in result.params)
    assert moved.changed().keys() == result.changed().keys()
