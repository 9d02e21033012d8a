"""The int4 decode path (bridge.kernels.decode) against F.linear(x, qt.dequantize(q)).

Tolerances are derived, not tuned: the exact variant differs from the reference by fp32 rounding
of sums over in_features; the int16 variant also rounds each activation by at most
2^-16 max|x_g| (per token and group) before multiplying it with ``(codes - qmin) * scale`` (the
zero point is applied through exact sums of x), so its error is bounded by that times the sum of
``|codes - qmin| * scale`` per group."""

import pytest
import torch
import torch.nn.functional as F

import qtransform as qt
from bridge.kernels import decode as D
from bridge.kernels import native

NATIVE = D.decode_available()
native_only = pytest.mark.skipif(not NATIVE, reason=f"decode kernel unavailable: {D.decode_unavailable_reason()}")
MODES = [pytest.param(True, marks=native_only, id="native"), pytest.param(False, id="torch")]

SPECS = [qt.QuantSpec(format=f, granularity=g, symmetric=sym)
         for f in ("int4", "uint4") for sym in (True, False)
         for g in (qt.PerGroup(32), qt.PerGroup(64), qt.PerGroup(128), qt.PerChannel(0))]
SPECS += [qt.QuantSpec(format="int4", granularity=qt.PerGroup(256), symmetric=False),
          qt.QuantSpec(format="uint3", granularity=qt.PerGroup(64), symmetric=False, zero_point_domain="float"),
          qt.QuantSpec(format="int2", granularity=qt.PerGroup(32), symmetric_range="restricted"),
          qt.QuantSpec(format="int4", granularity=qt.PerGroup(128), scale_dtype="bfloat16"),
          qt.QuantSpec(format="int4", granularity=qt.PerTensor()),
          qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="offset", scale_dtype="float16"),  # GGUF Q4_1
          qt.QuantSpec(format="int4", granularity=qt.PerChannel(0), symmetric=False, zero_point_domain="offset")]


def quantized(spec, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    return qt.quantize(w, qt.choose_qparams(w, spec))


def activations(rows, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, 3] = 25.0  # an outlier feature, as in real activations
    return x


def check(y, x, q, group, exact):
    """|y - F.linear(x, W)| within fp32 rounding (+ the int16 rounding bound when not exact)."""
    w = qt.dequantize(q)
    ref = F.linear(x.float(), w)
    n, k = w.shape
    absdot = F.linear(x.float().abs(), w.abs())  # scale of the fp32 rounding
    tol = 1e-5 * absdot + 1e-6 * ref.abs().max()
    if not exact:
        xmax = x.float().abs().view(x.shape[0], 1, k // group, group).amax(-1)  # (M, 1, G)
        s = q.qparams.effective()[0]
        nib = (qt.unpacked_codes(q).float() - q.spec.fmt.codec.qmin).view(n, s.shape[1], -1)
        wsum = (nib * s.expand(n, -1)[..., None]).reshape(n, k // group, group).sum(-1)  # (N, G)
        tol = tol + (xmax * wsum).sum(-1) * 2.0 ** -16 * 1.01
    assert y.shape == ref.shape
    assert bool(((y.float() - ref).abs() <= tol).all()), ((y.float() - ref).abs().max().item(), tol.min().item())


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("exact", [False, True], ids=["i16", "exact"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_matches_dequant_reference(spec, exact, native):
    n, k = 38, 512  # 38 rows: the last tile of 4 rows is padded
    q = quantized(spec, n, k)
    st = D.prepare_decode_qtensor(q, exact=exact, native=native)
    assert st.native is native and st.exact is exact
    for rows in range(1, 9):
        x = activations(rows, k, seed=rows)
        check(D.int4_decode_linear(x, st), x, q, st.group, exact)


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("n, k, spec", [
    (192, 576, qt.QuantSpec(format="int4", granularity=qt.PerGroup(64), symmetric=False)),
    (1536, 576, qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)),
    (577, 1536, qt.QuantSpec(format="int4", granularity=qt.PerGroup(128))),
    (64, 4096, qt.QuantSpec(format="int4", granularity=qt.PerChannel(0), symmetric=False)),
    (16, 8448, qt.QuantSpec(format="uint4", granularity=qt.PerChannel(0), symmetric=False)),  # sub-groups
    (3, 32, qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)),
], ids=["kv-576", "up-576", "577x1536", "perchannel-4096", "perchannel-8448", "tiny"])
def test_shapes(n, k, spec, native):
    q = quantized(spec, n, k, seed=n)
    for exact in (False, True):
        st = D.prepare_decode_qtensor(q, exact=exact, native=native)
        for rows in (1, 2, 5, 8):
            x = activations(rows, k, seed=rows)
            check(D.int4_decode_linear(x, st), x, q, st.group, exact)


@pytest.mark.parametrize("native", MODES)
def test_3d_input_bf16_and_many_rows(native):
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False)
    q = quantized(spec, 40, 256)
    st = D.prepare_decode_qtensor(q, native=native)
    x = activations(6, 256).view(2, 3, 256)
    y = D.int4_decode_linear(x, st)
    assert y.shape == (2, 3, 40)
    check(y.reshape(6, 40), x.reshape(6, 256), q, 64, exact=False)
    xb = x.bfloat16()
    yb = D.int4_decode_linear(xb, st)
    assert yb.dtype == torch.bfloat16
    ref = F.linear(xb.float(), qt.dequantize(q))
    assert (yb.float() - ref).abs().max() <= 2e-2 * ref.abs().max()  # the output rounded to bf16
    x = activations(37, 256)  # beyond DECODE_MAX_ROWS: slower, still right
    check(D.int4_decode_linear(x, st), x, q, 64, exact=False)
    assert D.int4_decode_linear(x[:0], st).shape == (0, 40)


def test_raw_codes_entry_and_zero_rows_weight():
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    scale, zero = torch.rand(8, 2) + 0.1, torch.randint(0, 16, (8, 2)).float()
    st = D.prepare_decode(codes, scale, zero)
    w = ((codes.float().view(8, 2, 32) - zero[..., None]) * scale[..., None]).view(8, 64)
    x = torch.randn(3, 64)
    torch.testing.assert_close(D.int4_decode_linear(x, st), x @ w.t(), rtol=1e-3, atol=1e-3)
    st1 = D.prepare_decode(codes, scale[:1], None)  # one row of scales broadcasts, no zero point
    w1 = (codes.float().view(8, 2, 32) * scale[:1, :, None]).view(8, 64)
    torch.testing.assert_close(D.int4_decode_linear(x, st1), x @ w1.t(), rtol=1e-3, atol=1e-3)


def test_inputs_unchanged():
    q = quantized(qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)), 8, 64)
    codes, (s, z) = qt.unpacked_codes(q).clone(), q.qparams.effective()
    s0 = s.clone()
    st = D.prepare_decode(codes, s, z, qmin=-8)
    x = torch.randn(2, 64)
    x0 = x.clone()
    D.int4_decode_linear(x, st)
    assert torch.equal(x, x0) and torch.equal(s, s0) and torch.equal(codes, qt.unpacked_codes(q))


def test_errors_name_the_problem():
    codes = torch.randint(0, 16, (8, 64))
    with pytest.raises(ValueError, match="codes must lie in"):
        D.prepare_decode(codes + 1, torch.ones(8, 2))
    with pytest.raises(ValueError, match="multiple of 32"):
        D.prepare_decode(codes, torch.ones(8, 4))  # groups of 16 need exact=True
    assert D.prepare_decode(codes, torch.ones(8, 4), exact=True, native=False).group == 16
    with pytest.raises(ValueError, match="2-D integer"):
        D.prepare_decode(codes.float(), torch.ones(8, 2))
    with pytest.raises(ValueError, match="scale must be 2-D"):
        D.prepare_decode(codes, torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"x2d must be \(rows, 64\)"):
        D.int4_decode_linear(torch.randn(2, 32), D.prepare_decode(codes, torch.ones(8, 2), native=False))
    q = quantized(qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)), 8, 64)
    assert "at most 4 bits" in D.decode_check(q)
    q = quantized(qt.QuantSpec(format="int4", granularity=qt.PerGroup(128), pad=True), 8, 576)  # padded last group
    assert D.decode_check(q) is not None
    with pytest.raises(ValueError, match="prepare_decode_qtensor"):
        D.prepare_decode_qtensor(q)


def test_no_compiler_fallback(monkeypatch):
    """Without a compiler the path reports why, packs for the torch fallback and stays correct."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    D._build.cache_clear()
    native.build_extension.cache_clear()
    try:
        assert not D.decode_available()
        assert "compiler" in D.decode_unavailable_reason()
        q = quantized(qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), symmetric=False), 12, 128)
        st = D.prepare_decode_qtensor(q)
        assert not st.native
        with pytest.raises(ValueError, match="native=True"):
            D.prepare_decode_qtensor(q, native=True)
        x = activations(3, 128)
        check(D.int4_decode_linear(x, st), x, q, 32, exact=True)  # the fallback is fp32-exact
    finally:
        monkeypatch.undo()
        D._build.cache_clear()
        native.build_extension.cache_clear()
    native.build_extension.cache_clear()
    assert D.decode_available() is NATIVE


@native_only
@pytest.mark.parametrize("exact", [False, True], ids=["i16", "exact"])
def test_torch_compile_fullgraph_and_opcheck(exact):
    q = quantized(qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False), 20, 256)
    st = D.prepare_decode_qtensor(q, exact=exact)
    x = activations(3, 256)
    eager = D.int4_decode_linear(x, st)
    compiled = torch.compile(lambda t: D.int4_decode_linear(t, st), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), eager)
    op = torch.ops.qtransform_decode.int4_gemv if exact else torch.ops.qtransform_decode.int4_gemv_i16
    torch.library.opcheck(op, (x, st.packed, st.scale, st.mzero, st.group, st.out_features),
                          test_utils=("test_schema", "test_faketensor"))
