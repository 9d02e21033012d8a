"""A streamed run with the block on CUDA, for the steps beyond GPTQ (test_stream_inputs.py has GPTQ): the
rotations (drawn on the host, put on the block's device), AWQ and the static fp8 and KV-cache scales; the
checkpoint has the CPU run's tensors, dtypes and shapes."""

from __future__ import annotations

import pytest
import torch

import qtransform as qt
from bridge.stream import quantize_checkpoint

from stream_util import save_tiny

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (make test-gpu on a GPU machine)")
CALIB = [torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("stream-device") / "src")


def _tensors(directory):
    from safetensors import safe_open

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["quarot-w4a8", "awq4-g64", "fp8-w8a8-kv"])
def test_the_streamed_block_on_cuda_writes_the_cpu_runs_tensors(source, tmp_path, preset):
    recipe = qt.get_preset(preset).recipe
    quantize_checkpoint(source, tmp_path / "gpu", recipe, calibration=CALIB, device="cuda")
    quantize_checkpoint(source, tmp_path / "cpu", recipe, calibration=CALIB)
    a, b = _tensors(tmp_path / "gpu"), _tensors(tmp_path / "cpu")
    assert a.keys() == b.keys()
    for k, t in b.items():
        assert a[k].dtype == t.dtype and a[k].shape == t.shape, k
        if t.is_floating_point():
            assert bool(torch.isfinite(a[k].float()).all()), k
