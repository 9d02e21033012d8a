"""Mixture-of-experts on CUDA (``make test-gpu`` on a GPU machine; skipped without CUDA): the quantized experts'
routed forward on CUDA equals the CPU one to float noise, and GPTQ per expert with the model on CUDA matches the
CPU run but at near-ties (the bound of tests/bridge/calibrate/test_steps_cuda.py: at least 95% of the codes equal)."""

import copy

import pytest
import torch

import bridge
import qtransform as qt
from bridge.app.placement import to_host

from .tiny_moe import build_tiny_moe

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (make test-gpu on a GPU machine)")
IDS = torch.tensor([[3, 7, 1, 9, 22, 5, 14, 2, 8, 31, 4, 6]])


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_qexperts_forward_on_cuda_equals_cpu(model_type):
    qmodel = bridge.quantize(build_tiny_moe(model_type), qt.get_preset("int4-g32").recipe, kernel="dequant")
    with torch.no_grad():
        want = qmodel(IDS).logits
        got = copy.deepcopy(qmodel).to("cuda")(IDS.cuda()).logits.cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


@needs_cuda
@pytest.mark.cuda
def test_gptq_per_expert_on_cuda_matches_cpu_but_at_near_ties():
    model = build_tiny_moe("qwen3_moe")
    cal = [torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    recipe = qt.get_preset("gptq4-g64").recipe
    cpu = bridge.quantize_params(model, recipe, calibration=cal)
    on = copy.deepcopy(model).to("cuda")
    gpu = to_host(bridge.quantize_params(on, recipe, calibration=[c.cuda() for c in cal]), host=bridge.extract(model))
    for path, q in cpu.qtree.items():
        if isinstance(q, qt.QTensor) and path.endswith(("gate_up_proj", "down_proj")):
            a, b = qt.unpacked_codes(q), qt.unpacked_codes(gpu.qtree[path])
            assert (a == b).float().mean() >= 0.95, path
            assert cpu.info[path]["experts"]["tokens"] == gpu.info[path]["experts"]["tokens"]
