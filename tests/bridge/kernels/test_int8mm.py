"""The CPU W8A8 int8 kernel (``torch._int_mm``) against the fake-quantized reference and exact integer sums."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform as qt
from bridge import QLinear
from bridge_util import w8a8_reference
from bridge.kernels import int8mm

K, N = 256, 64
NAME = "int8_int_mm_cpu"

W_SPECS = [qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)),
           qt.QuantSpec(format="int8", granularity=qt.PerTensor()),
           qt.QuantSpec(format="uint8", granularity=qt.PerChannel(0)),  # symmetric: fixed zero point 128
           qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), symmetric_range="restricted")]


def _static(spec):
    torch.manual_seed(1)
    return qt.choose_qparams(torch.randn(40, K) * 2 + 0.5, spec)  # calibrated on other data


X_QUANT = {
    "dyn-token-sym": qt.QuantSpec(format="int8", dynamic=True, granularity=qt.PerChannel(0)),
    "dyn-tensor-sym": qt.QuantSpec(format="int8", dynamic=True),
    "dyn-token-asym": qt.QuantSpec(format="int8", dynamic=True, granularity=qt.PerChannel(0), symmetric=False),
    "dyn-tensor-uint8-asym": qt.QuantSpec(format="uint8", dynamic=True, symmetric=False),
    "dyn-token-uint8-sym": qt.QuantSpec(format="uint8", dynamic=True, granularity=qt.PerChannel(0)),
    "static-tensor-sym": _static(qt.QuantSpec(format="int8")),
    "static-tensor-uint8-asym": _static(qt.QuantSpec(format="uint8", symmetric=False)),
}


def make(wspec, xquant, *, bias=True, seed=0, **kw):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    w = lin.weight.detach()
    q = qt.quantize(w, qt.choose_qparams(w, wspec))
    return QLinear.from_float(lin, q, input_quant=xquant, **kw), q, lin.bias


@pytest.mark.parametrize("wspec", W_SPECS, ids=str)
@pytest.mark.parametrize("xname", list(X_QUANT))
@pytest.mark.parametrize("shape", [(7, K), (2, 5, K)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_fake_quant_reference(wspec, xname, shape, bias):
    m, q, b = make(wspec, X_QUANT[xname], bias=bias, kernel=NAME)
    assert m.kernel == NAME
    torch.manual_seed(2)
    x = torch.randn(*shape) * 2 + 0.5
    y = m(x)
    assert y.shape == (*shape[:-1], N) and y.dtype == x.dtype
    # the reference written out: fake-quantize the (tokens, features) matrix, dequantize W, F.linear
    qp = m.input_qparams(x)
    assert tuple(qp.scale.shape) == ((shape[0] * (shape[1] if len(shape) == 3 else 1), 1)
                                     if "token" in xname else (1, 1))
    ref = F.linear(qt.fake_quantize(x.reshape(-1, K), qp).reshape(shape), qt.dequantize(q), b)
    y64, mag = w8a8_reference(m, x)
    # float32 sums of K products: the reference's own rounding is below 2^-16 of the sum of magnitudes
    assert ((y - ref).abs() <= 2.0 ** -16 * mag + 1e-6).all()
    # the integer accumulation is exact: only the int32 -> float conversion, two products (and the bias) round
    y_nb = y if b is None else y - b
    tol = 2.0 ** -21 * y64.abs() + (0 if b is None else 2.0 ** -22 * (y.abs() + b.abs()).double())
    assert ((y_nb.double() - y64).abs() <= tol + 1e-30).all()
    m.kernel = "dequant"  # forced reference: the module's other path agrees
    assert torch.allclose(m(x), ref, rtol=0, atol=1e-6)


def test_exact_at_the_int32_limit():
    """Extreme codes at in_features = MAX_IN_FEATURES: (a - za) * b summed stays exact in int32."""
    k, n = int8mm.MAX_IN_FEATURES, 8
    wspec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    codes = torch.full((n, k), -128, dtype=torch.int8)
    scale = torch.tensor([2.0 ** -i for i in range(n)]).reshape(n, 1)
    q = qt.QTensor(codes=codes, qparams=qt.QParams(scale=scale, spec=wspec), width=k, dtype=torch.float32)
    xspec = qt.QuantSpec(format="int8", symmetric=False)
    xq = qt.QParams(scale=torch.ones(1, 1), zero_point=torch.full((1, 1), 127, dtype=torch.int8), spec=xspec)
    m = QLinear(q, input_quant=xq, kernel=NAME)
    x = torch.full((2, k), -1000.0)  # clamps to code -128: (-128 - 127) * (-128) = 32640 per term
    want = torch.tensor([k * 32640 * 2.0 ** -i for i in range(n)])  # 2139062400 * 2^-i, exact in float32
    assert k * 32640 < 2 ** 31 and torch.equal(m(x), want.expand(2, n))


def test_hand_computed_asymmetric_per_token():
    """Integer activations with power-of-two scales: every product is exact, so the result is too."""
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    b = torch.tensor([[1, -2, 3, 4], [-128, 127, 0, 5]], dtype=torch.int8)
    q = qt.QTensor(codes=b, qparams=qt.QParams(scale=torch.tensor([[0.5], [0.25]]), spec=spec),
                   width=4, dtype=torch.float32)
    xspec = qt.QuantSpec(format="int8", dynamic=True, granularity=qt.PerChannel(0), symmetric=False)
    m = QLinear(q, torch.tensor([1.0, -1.0]), input_quant=xspec, kernel=NAME)
    x = torch.tensor([[0.0, 255.0, 10.0, 100.0], [-8.0, 0.0, 0.0, 247.0]])  # ranges of 255: scale 1,
    # zero points -128 and -120: codes x - 128 and x - 120 in [-128, 127] represent x exactly
    want = x @ (b.float() * torch.tensor([[0.5], [0.25]])).t() + torch.tensor([1.0, -1.0])
    assert torch.equal(m(x), want)


@pytest.fixture
def int8_dot(monkeypatch):
    """Pretend this CPU has int8 dot-product instructions (the condition for ``auto``)."""
    monkeypatch.setattr(int8mm, "int8_dot_cpu", lambda: True)


def test_auto_never_chooses_it_forcing_works_where_eligible(int8_dot):
    for wspec in W_SPECS:
        for xquant in X_QUANT.values():
            m, q, b = make(wspec, xquant)
            assert m.kernel != NAME and NAME not in m.available_kernels(), (wspec, xquant)
            m.kernel = NAME
            assert m.kernel == NAME
    m, q, b = make(W_SPECS[0], X_QUANT["dyn-token-sym"], kernel="dequant")
    assert m.kernel == "dequant"
    x = torch.randn(3, K)
    ref = F.linear(qt.fake_quantize(x, qt.choose_qparams(x, X_QUANT["dyn-token-sym"])), qt.dequantize(q), b)
    assert torch.equal(m(x), ref)


INELIGIBLE = [
    (qt.QuantSpec(format="int8", granularity=qt.PerGroup(32)), X_QUANT["dyn-token-sym"], "per-channel"),
    (qt.QuantSpec(format="int4", granularity=qt.PerChannel(0)), X_QUANT["dyn-token-sym"], "8-bit"),
    (qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), symmetric=False), X_QUANT["dyn-token-sym"],
     "asymmetric"),
    (W_SPECS[0], None, "no input quantizer"),
    (W_SPECS[0], qt.QuantSpec(format="int4", dynamic=True, granularity=qt.PerChannel(0)), "8-bit"),
    (W_SPECS[0], qt.QuantSpec(format="int8", dynamic=True, granularity=qt.PerChannel(-1)), "per-token"),
    (W_SPECS[0], qt.QuantSpec(format="int8", dynamic=True, granularity=qt.PerGroup(32)), "per-token"),
    (W_SPECS[0], qt.QuantSpec(format="uint8", dynamic=True, symmetric=False, zero_point_domain="float"),
     "float zero point"),
]


@pytest.mark.parametrize("wspec,xquant,reason", INELIGIBLE, ids=lambda v: str(v))
def test_ineligible_configurations_never_choose_it(int8_dot, wspec, xquant, reason):
    m, q, b = make(wspec, xquant)
    assert m.kernel != NAME and NAME not in m.available_kernels()
    with pytest.raises(ValueError, match=f"{NAME}.*{reason}"):
        m.kernel = NAME


def test_fp8_weights_and_in_features_limit(int8_dot):
    fp8 = [f for f, v in qt.FORMATS.items() if v.codec.code_dtype == torch.float8_e4m3fn and v.block is None]
    if fp8:
        m, _, _ = make(qt.QuantSpec(format=fp8[0], granularity=qt.PerChannel(0)), X_QUANT["dyn-token-sym"])
        assert NAME not in m.available_kernels()
    k = int8mm.MAX_IN_FEATURES + 1
    w = torch.randn(8, k)
    q = qt.quantize(w, qt.choose_qparams(w, W_SPECS[0]))
    m = QLinear(q, input_quant=X_QUANT["dyn-token-sym"])
    assert m.kernel != NAME
    with pytest.raises(ValueError, match=f"in_features {k} exceeds"):
        m.kernel = NAME


def test_not_auto_without_int8_dot_instructions(monkeypatch):
    monkeypatch.setattr(int8mm, "int8_dot_cpu", lambda: False)
    m, q, b = make(W_SPECS[0], X_QUANT["static-tensor-sym"])  # (dynamic per-token inputs: int8_dynamic_cpu)
    assert m.kernel == "int8pack_cpu" and NAME not in m.available_kernels()
    m.kernel = NAME  # forcing it still works
    assert m.kernel == NAME


def test_empty_and_bfloat16_inputs():
    m, q, b = make(W_SPECS[0], X_QUANT["dyn-token-sym"], kernel=NAME)
    assert m(torch.randn(0, K)).shape == (0, N) and m(torch.randn(2, 0, K)).shape == (2, 0, N)
    m.to(torch.bfloat16)
    x = torch.randn(4, K).bfloat16()
    y = m(x)
    assert y.dtype == torch.bfloat16
    y64, mag = w8a8_reference(m, x)  # the codes of the bf16 input; two bf16 roundings remain (output, + bias): 2^-8 each
    assert ((y.double() - b.double() - y64).abs() <= 2.0 ** -7 * (y64.abs() + b.double().abs())).all()
