"""The many-token path of the packed CPU kernels (dequantize into a buffer, then ``F.linear``) and
the padded groups that the int4 kernel now takes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform as qt
from bridge import QLinear
from bridge.kernels import dense

SPECS = [
    (qt.QuantSpec(format="int4", granularity=qt.PerGroup(64)), 256),
    (qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False), 256),
    (qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False, zero_point_domain="float"), 256),
    (qt.QuantSpec(format="int4", granularity=qt.PerChannel(0)), 256),
    (qt.QuantSpec(format="int4", granularity=qt.PerGroup(128), pad=True), 576),  # SmolLM2's width: last group 64
    (qt.QuantSpec(format="int3", granularity=qt.PerGroup(32)), 256),  # codes of fewer bits: unpacked per call
    (qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)), 256),
    (qt.QuantSpec(format="uint8", granularity=qt.PerTensor(), symmetric=True), 256),
    (qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="offset", scale_dtype="float16"), 256),  # GGUF Q4_1
]


def _module(spec, k, n=64):
    torch.manual_seed(0)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight[:, -64:] *= 30  # the last group's range far from the others'
    w = lin.weight.detach()
    return QLinear.from_float(lin, qt.quantize(w, qt.choose_qparams(w, spec))), lin.bias


def _reference(m, bias, x):
    """float64 F.linear on the dequantized weight (independent of the kernels)."""
    return F.linear(x.double(), qt.dequantize(m.qweight).double(), bias.double())


@pytest.mark.parametrize("spec,k", SPECS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_path_is_the_float_op_on_the_dequantized_weight(spec, k, dtype, monkeypatch):
    m, bias = _module(spec, k)
    assert m.kernel in ("int4pack_cpu", "int8pack_cpu")
    rows = dense.PREFILL_ROWS[m.kernel]
    calls = []
    real = dense.dense_linear
    monkeypatch.setattr(dense, "dense_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    m.to(dtype)
    x = torch.randn(2, rows, k, dtype=dtype)  # 2 * rows tokens: above the threshold
    y = m(x)
    assert calls and y.dtype == dtype
    ref = _reference(m, bias.to(dtype), x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # fp32 GEMM: float rounding only (the packed kernel: bf16)
    assert (y.double() - ref).abs().max() <= tol * ref.abs().max()
    calls.clear()
    m(x[:1, : rows - 1])  # below it: the packed kernel
    assert not calls


def test_threshold_is_a_setting(monkeypatch):
    m, bias = _module(*SPECS[0])
    x = torch.randn(3, 256)
    monkeypatch.setitem(dense.PREFILL_ROWS, "int4pack_cpu", 2)
    ref = _reference(m, bias, x)
    assert (m(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # dense: float exact
    monkeypatch.setitem(dense.PREFILL_ROWS, "int4pack_cpu", None)
    err = (m(x).double() - ref).abs().max()
    assert 1e-5 * ref.abs().max() < err <= 2e-2 * ref.abs().max()  # packed: bf16 rounding, never dense


def test_buffers_are_reused_and_do_not_leak_between_layers():
    """Two layers of different shapes in turn: each result its own (the buffer is refilled)."""
    a, ba = _module(*SPECS[0])
    b, bb = _module(qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False), 128, n=32)
    xa, xb = torch.randn(64, 256), torch.randn(64, 128)
    ya, yb, ya2 = a(xa), b(xb), a(xa)
    assert torch.equal(ya, ya2)
    for y, m, bias, x in ((ya, a, ba, xa), (yb, b, bb, xb)):
        ref = _reference(m, bias, x)
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    dense.release_buffers()
    assert torch.equal(a(xa), ya)


@pytest.mark.parametrize("spec,k", SPECS[:2] + SPECS[6:7], ids=lambda v: str(v))
def test_compiled_dequantization_matches_eager(spec, k):
    m, _ = _module(spec, k)
    q = m.qweight
    s, off = dense.affine_params(q)
    codes = q.codes if spec.fmt.codec.bits in (4, 8) else qt.unpacked_codes(q)
    fn = lambda: dense.dequantize_int(codes, s, off, k, torch.float32, signed=spec.fmt.codec.signed)  # noqa: E731
    eager = fn().clone()
    torch.testing.assert_close(eager, qt.dequantize(q), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(), eager, rtol=1e-6, atol=1e-6)


def test_padded_group_runs_the_packed_kernel_at_decode():
    """int4 g128 on 576 inputs (SmolLM2): the packed kernel (group 64, each scale on two kernel
    groups, the padded block on one); on the wave-1 main it fell back to ``dequant``."""
    m, bias = _module(*SPECS[4])
    assert m.kernel == "int4pack_cpu"
    x = torch.randn(1, 576)
    ref = _reference(m, bias, x)
    assert (m(x).double() - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize("spec,k", SPECS[:5] + SPECS[-1:], ids=lambda v: str(v))
def test_native_and_plain_dequantization_agree(spec, k, monkeypatch):
    """The AVX2 pass (built at first use) and the plain tensor ops give the same weight."""
    m, _ = _module(spec, k)
    q = m.qweight
    block = spec.granularity.block_size(tuple(q.shape))[-1]
    s, off = (t.repeat_interleave(block // 32, dim=1)[:, : k // 32].contiguous() for t in dense.affine_params(q))
    signed = spec.fmt.codec.signed
    got = dense.dequantize_int(q.codes, s, off, k, torch.float32, signed=signed).clone()
    monkeypatch.setattr(dense.native, "build_extension", lambda *a, **kw: (None, "turned off by the test"))
    plain = dense.dequantize_int(q.codes, s, off, k, torch.float32, signed=signed)
    ref = qt.dequantize(q)
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 1e-6 * scale and (plain - ref).abs().max() <= 1e-6 * scale
