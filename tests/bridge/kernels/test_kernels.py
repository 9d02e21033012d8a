"""Every fast path against the dequantize reference (bf16 tolerances for the packed CPU kernels)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform as qt
from bridge import QLinear, kernels
from qtransform.formats import Codec, Format, register_format


def make(spec, n=64, k=256, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    w = lin.weight.detach()
    return lin, qt.quantize(w, qt.choose_qparams(w, spec))


def close_bf16(y, ref):
    """bf16 kernels: activations/scales rounded to bf16 (relative 2^-8 each), fp32 accumulation."""
    err = (y - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 2e-2 * scale, (err, scale)


INT4_SPECS = [qt.QuantSpec(format=f, granularity=g, symmetric=sym)
              for f in ("int4", "uint4") for sym in (True, False)
              for g in (qt.PerGroup(32), qt.PerGroup(64), qt.PerGroup(128), qt.PerGroup(256), qt.PerChannel(0))]
INT4_SPECS += [qt.QuantSpec(format="uint3", granularity=qt.PerGroup(64), symmetric=False, zero_point_domain="float"),
               qt.QuantSpec(format="int2", granularity=qt.PerGroup(32), symmetric_range="restricted"),
               qt.QuantSpec(format="int4", granularity=qt.PerGroup(128), scale_dtype="bfloat16"),
               qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="offset", scale_dtype="float16"),  # GGUF Q4_1
               qt.QuantSpec(format="int4", granularity=qt.PerGroup(64), symmetric=False, zero_point_domain="offset")]


@pytest.mark.parametrize("spec", INT4_SPECS, ids=str)
@pytest.mark.parametrize("batch", [(1,), (3, 7)])
def test_int4pack_matches_reference(spec, batch):
    lin, q = make(spec)
    m = QLinear.from_float(lin, q)
    assert m.kernel == "int4pack_cpu"
    x = torch.randn(*batch, 256)
    ref = F.linear(x, qt.dequantize(q), lin.bias)
    close_bf16(m(x), ref)
    m.to(torch.bfloat16)
    xb = x.bfloat16()
    refb = F.linear(xb.float(), qt.dequantize(q), lin.bias.float())
    close_bf16(m(xb).float(), refb)
    assert m(xb).dtype == torch.bfloat16


def test_int4pack_zero_point_convention(monkeypatch):
    # scales, zero points and activations that bf16 holds exactly: only the bf16 output is rounded
    # (the aten int4pack path: the decode GEMV, tests/bridge/kernels/test_decode.py, is turned off)
    monkeypatch.setattr(kernels.decode, "DECODE_MAX_ROWS", 0)
    spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)
    n, k = 32, 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.full((n, k // 32), 0.25)
    zp = torch.randint(0, 16, (n, k // 32), dtype=torch.uint8)
    q = qt.QTensor(codes=qt.pack(codes, 4), qparams=qt.QParams(scale=scale, zero_point=zp, spec=spec),
                   width=k, dtype=torch.float32)
    m = QLinear(q)
    assert m.kernel == "int4pack_cpu"
    x = torch.randint(-4, 5, (5, k)).float()
    w = (codes.float() - zp.float().repeat_interleave(32, 1)) * 0.25
    ref = x @ w.t()
    assert ((m(x) - ref).abs() <= ref.abs() * 2 ** -8).all()


@pytest.mark.parametrize("spec", [qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)),
                                  qt.QuantSpec(format="uint8", granularity=qt.PerChannel(0)),
                                  qt.QuantSpec(format="int8", granularity=qt.PerTensor())], ids=str)
def test_int8pack_matches_reference(spec):
    lin, q = make(spec)
    m = QLinear.from_float(lin, q)
    assert m.kernel == "int8pack_cpu"
    x = torch.randn(4, 256)
    close_bf16(m(x), F.linear(x, qt.dequantize(q), lin.bias))


def test_ineligible_cases_fall_back():
    asym8 = make(qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), symmetric=False))
    # an offset zero point of 128 in every row is not the symmetric uint8 zero point
    off8 = make(qt.QuantSpec(format="uint8", granularity=qt.PerChannel(0), symmetric=False, zero_point_domain="offset"))
    g16 = make(qt.QuantSpec(format="int4", granularity=qt.PerGroup(16)))
    odd_n = make(qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)), n=40)
    nf4 = make(qt.QuantSpec(format="nf4"))
    for lin, q in (asym8, off8, g16, odd_n, nf4):
        m = QLinear.from_float(lin, q)
        assert m.kernel == "dequant", q.spec
        x = torch.randn(2, 256)
        assert torch.allclose(m(x), F.linear(x, qt.dequantize(q), lin.bias), atol=1e-5)
    m = QLinear.from_float(*g16)
    with pytest.raises(ValueError, match="int4pack_cpu.*per-group"):
        m.kernel = "int4pack_cpu"


def test_forced_dequant_and_cache_follows_weight_changes():
    lin, q = make(qt.QuantSpec(format="int4", granularity=qt.PerGroup(64)))
    m = QLinear.from_float(lin, q, kernel="dequant")
    x = torch.randn(2, 256)
    exact = F.linear(x, qt.dequantize(q), lin.bias)
    assert m.kernel == "dequant" and torch.allclose(m(x), exact, atol=1e-6)
    m.kernel = "auto"
    y0 = m(x)
    _, q2 = make(qt.QuantSpec(format="int4", granularity=qt.PerGroup(64)), seed=1)
    m.set_qweight(q2)  # new buffers: the packed cache must be rebuilt
    close_bf16(m(x), F.linear(x, qt.dequantize(q2), lin.bias))
    with torch.no_grad():
        m.weight.copy_(q.codes)  # in-place change of the codes (version counter)
        m.weight_scale.copy_(q.qparams.scale)
    assert torch.equal(m(x), y0)


def test_fp8_scaled_mm_function_matches_reference():
    torch.manual_seed(0)
    xc = (torch.randn(16, 64) * 4).to(torch.float8_e4m3fn)
    wc = (torch.randn(32, 64) * 4).to(torch.float8_e4m3fn)
    for sx, sw in ((torch.tensor(0.5), torch.tensor(0.25)), (torch.rand(16, 1) + 0.5, torch.rand(32, 1) + 0.5)):
        try:
            y = kernels.fp8_linear(xc, sx, wc, sw, out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError) as e:  # builds whose _scaled_mm is GPU-only
            pytest.skip(f"torch._scaled_mm unavailable on CPU here: {e}")
        ref = (xc.float() * sx.reshape(-1, 1)) @ (wc.float() * sw.reshape(-1, 1)).t()
        assert torch.allclose(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_fp8_not_chosen_without_gpu_or_input_quantizer():
    lin, q = make(qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)))
    m = QLinear.from_float(lin, q)
    assert "fp8_scaled_mm" not in m.available_kernels()
    with pytest.raises(ValueError, match="fp8_scaled_mm.*float8_e4m3fn"):
        m.kernel = "fp8_scaled_mm"


class _CastE4M3(Codec):
    """Minimal float8_e4m3fn codec (the plain cast), for when the registry has no fp8 format yet."""

    bits, code_dtype, signed, emax, mbits = 8, torch.float8_e4m3fn, True, 8, 3

    def qrange(self, *, symmetric, restricted):
        return -448.0, 448.0

    def encode(self, v, *, rounding, noise=None, lo=None, hi=None):
        return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def decode(self, codes):
        return codes.to(torch.float32)

    def half_spacing(self, v):
        e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6)))
        return torch.exp2(e - 4)


@pytest.fixture
def fp8_format():
    from qtransform.formats import base
    have = [n for n, f in qt.FORMATS.items() if f.codec.code_dtype == torch.float8_e4m3fn and f.block is None]
    if have:
        yield have[0]
        return
    name = "test_cast_e4m3"
    register_format(Format(name=name, codec=_CastE4M3(), family="float", symmetric_only=True,
                           scale_dtypes=("float32",)))
    try:
        yield name
    finally:
        base._REGISTRY.pop(name, None)


def test_fp8_module_path_matches_fake_quant_reference(fp8_format):
    for gran in (qt.PerTensor(), qt.PerChannel(0)):
        spec = qt.QuantSpec(format=fp8_format, granularity=gran)
        lin, q = make(spec)
        inp = qt.QuantSpec(format=fp8_format, dynamic=True, granularity=gran)
        if gran == qt.PerChannel(0) and not kernels.fp8.rowwise_scales(torch.device("cpu")):  # torch 2.11
            with pytest.raises(ValueError, match="per-tensor scales only on cpu"):
                QLinear.from_float(lin, q, input_quant=inp, kernel="fp8_scaled_mm")
            continue
        m = QLinear.from_float(lin, q, input_quant=inp, kernel="fp8_scaled_mm")
        assert m.kernel == "fp8_scaled_mm"
        assert "fp8_scaled_mm" not in m.available_kernels()  # auto needs CUDA capability >= 8.9
        x = torch.randn(16, 256)
        ref = F.linear(qt.fake_quantize(x, qt.choose_qparams(x, inp)), qt.dequantize(q), lin.bias)
        close_bf16(m(x), ref)
