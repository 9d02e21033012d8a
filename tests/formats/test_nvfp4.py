"""NVFP4: two-level scales by hand, and agreement with torchao's NVFP4Tensor and compressed-tensors."""

from __future__ import annotations

import pytest
import torch

import qtransform as qt

SPEC = qt.QuantSpec(format="nvfp4")


def _data(seed=0, rows=64, cols=256):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * torch.exp2(torch.empty(rows, 1).uniform_(-3, 3, generator=gen))


def test_spec_defaults():
    assert SPEC.granularity == qt.PerGroup(16) and SPEC.scale_dtype == "float8_e4m3fn" and not SPEC.power_of_two
    with pytest.raises(ValueError, match="intrinsic block of 16"):
        qt.QuantSpec(format="nvfp4", granularity=qt.PerGroup(32))
    with pytest.raises(ValueError, match="does not allow scale_dtype='e8m0'"):
        qt.QuantSpec(format="nvfp4", scale_dtype="e8m0")


def test_two_level_scales_by_hand():
    x = torch.zeros(3, 16)
    x[0, 0], x[1, 0] = 12.0, 0.9  # tensor amax 12; row 2 all zero
    qp = qt.choose_qparams(x, SPEC)
    g = 12.0 / (448 * 6)
    assert qp.global_scale.dtype == torch.float32 and qp.global_scale.shape == ()
    assert qp.global_scale.item() == pytest.approx(g, rel=1e-7)
    # block scales fp8(amax_b / 6 / g): 448 exactly; 0.15 / g = 33.6 -> 32 (round to nearest); zero -> 2^-6
    assert qp.scale.dtype == torch.float8_e4m3fn
    assert qp.scale.float().flatten().tolist() == [448.0, 32.0, 2.0 ** -6]
    y = qt.dequantize(qt.quantize(x, qp))
    assert y[0, 0].item() == pytest.approx(12.0, rel=1e-6)
    # 0.9 / (32 g) = 6.3 saturates at 6: rounding the block scale to nearest may clip by < 1/16
    assert y[1, 0].item() == pytest.approx(6 * 32 * g, rel=1e-6)
    assert bool((y[2] == 0).all())
    assert bool(((y - x).abs() <= qt.error_bound(x, qp) * (1 + 1e-6)).all())


def test_all_zero_tensor():
    z = torch.zeros(2, 32)
    qp = qt.choose_qparams(z, SPEC)
    assert qp.global_scale.item() == 1.0 and bool((qp.scale.float() == 2.0 ** -6).all())
    assert torch.equal(qt.dequantize(qt.quantize(z, qp)), z)


def test_storage_and_bits():
    x = _data(rows=8, cols=64)
    q = qt.quantize(x, qt.choose_qparams(x, SPEC))
    assert q.codes.dtype == torch.uint8 and tuple(q.codes.shape) == (8, 32)
    assert tuple(q.qparams.scale.shape) == (8, 4)
    assert q.bits_per_element() == 4.5 + 32 / x.numel() == qt.bits_per_element(SPEC, x.shape)
    assert qt.bits_per_element(SPEC) == 4.5


def test_agrees_with_torchao_bit_for_bit():
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    x = _data(seed=1)
    t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax()))
    q = qt.quantize(x, qt.choose_qparams(x, SPEC))
    assert torch.equal(q.qparams.global_scale, t.per_tensor_scale.reshape(()))
    assert torch.equal(q.qparams.scale.view(torch.uint8), t.scale.view(torch.uint8))
    assert torch.equal(q.codes, t.qdata.view(torch.uint8))
    assert torch.equal(qt.dequantize(q), t.dequantize(torch.float32))


def test_agrees_with_compressed_tensors():
    """Same tensor scale (as its reciprocal), same fp8 block scales, same fp4 elements. compressed-tensors
    keeps subnormal fp8 block scales and scales by ``fp8 / (1/g)``, so dequantized values may differ
    from ours in the last bit, and blocks below 2^-6 of the largest block scale differ."""
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    x = _data(seed=2)
    args = NVFP4["weights"]
    gparam = generate_gparam(x.amin(), x.amax())
    blocks = x.reshape(x.shape[0], -1, 16)
    scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gparam)
    qp = qt.choose_qparams(x, SPEC)
    assert qp.global_scale.item() == pytest.approx(1 / gparam.item(), rel=1e-6)
    assert torch.equal(qp.scale.float(), scale.float())
    elements = ct_quantize(x, scale, zp, args, global_scale=gparam)
    ours = SPEC.fmt.codec.decode(qt.unpacked_codes(qt.quantize(x, qp)))
    assert torch.equal(ours, elements.float())
