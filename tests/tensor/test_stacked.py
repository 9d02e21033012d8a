"""Stacked matrices (mixture-of-experts tensors): a stacked spec quantizes each matrix exactly as its
matrix spec quantizes that matrix alone; take/matrix/stack move between the two without decoding."""

import pytest
import torch

import qtransform as qt
from qtransform.tensor import stacked

MATRIX_SPECS = [
    qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)),
    qt.QuantSpec(format="int8", granularity=qt.PerChannel(1)),
    qt.QuantSpec(format="int4", granularity=qt.PerGroup(16), symmetric=False),
    qt.QuantSpec(format="uint4", granularity=qt.PerGroup(16, axis=0), symmetric=False, zero_point_domain="float",
                 scale_dtype="float16"),
    qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerTensor()),
    qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerBlock((8, 16))),
    qt.QuantSpec(format="int4", granularity=qt.PerGroup(24), pad=True),
    qt.QuantSpec(format="mxfp4"),
]


@pytest.mark.parametrize("spec", MATRIX_SPECS, ids=str)
def test_a_stacked_spec_quantizes_each_matrix_as_its_matrix_spec(spec):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 16, 64, generator=g) * torch.linspace(0.1, 3, 5).view(5, 1, 1)  # experts of unlike ranges
    s3 = qt.stacked_spec(spec, w.shape)
    q3 = qt.quantize(w, qt.choose_qparams(w, s3))
    for e in range(5):
        alone = qt.quantize(w[e], qt.choose_qparams(w[e], spec))  # expected: the matrix quantized by itself
        got = stacked.matrix(q3, e)
        assert got.spec.granularity.block_size((16, 64)) == spec.granularity.block_size((16, 64))
        assert torch.equal(got.codes, alone.codes)
        for name, t in alone.qparams.tensors().items():
            assert torch.equal(got.qparams.tensors()[name], t), name
    assert qt.matrix_spec(s3, w.shape).granularity.block_size((16, 64)) == spec.granularity.block_size((16, 64))


def test_take_keeps_the_stack_and_stack_inverts_matrix():
    w = torch.randn(6, 8, 32)
    s3 = qt.stacked_spec(qt.QuantSpec(format="int4", granularity=qt.PerGroup(16)), w.shape)
    q = qt.quantize(w, qt.choose_qparams(w, s3))
    idx = torch.tensor([4, 1, 1])
    sub = stacked.take(q, idx)
    assert tuple(sub.shape) == (3, 8, 32)
    assert torch.equal(qt.dequantize(sub), qt.dequantize(q)[idx])
    back = stacked.stack([stacked.matrix(q, e) for e in range(6)])
    assert back.spec == q.spec and torch.equal(back.codes, q.codes)


def test_nvfp4_experts_share_one_tensor_scale():
    w = torch.randn(3, 8, 32)
    s3 = qt.stacked_spec(qt.QuantSpec(format="nvfp4"), w.shape)
    q = qt.quantize(w, qt.choose_qparams(w, s3))
    m = stacked.matrix(q, 1)
    assert m.qparams.global_scale is q.qparams.global_scale
    assert torch.equal(qt.dequantize(m), qt.dequantize(q)[1])


def test_bad_stacks_are_refused_by_name():
    with pytest.raises(ValueError, match="shares scales across"):
        qt.matrix_spec(qt.QuantSpec(format="int8", granularity=qt.PerTensor()), (4, 8, 8))
    with pytest.raises(ValueError, match="stack, rows, cols"):
        qt.stacked_spec(qt.QuantSpec(format="int8"), (8, 8))
    w = torch.randn(2, 8, 32)
    q = qt.quantize(w, qt.choose_qparams(w, qt.stacked_spec(qt.QuantSpec(format="int8"), w.shape)))
    with pytest.raises(ValueError, match="index must be an int"):
        stacked.matrix(q, 2)
    a = stacked.matrix(q, 0)
    b = qt.quantize(w[1], qt.choose_qparams(w[1], qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))))
    with pytest.raises(ValueError, match="share spec"):
        stacked.stack([a, b])
