"""The fused int8 per-token input quantizer and the ``int8_dynamic_cpu`` kernel (bridge.kernels.int8dyn).

The fused quantizer must give the general path's numbers exactly (codes, scales, zero points: the
same float32 operations), so its tests compare bit for bit with ``qt.quantize(x, qt.choose_qparams(x,
spec))``. The kernel's integer sums are exact: it equals ``int8_int_mm_cpu`` (``torch._int_mm`` on the
same codes) bit for bit, and the float64 reference on the codes to the rounding of the int32 -> float
conversion and the two rescaling products."""

import pytest
import torch
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp
import numpy as np

import qtransform as qt
from qtransform.testing import tensors_for
from bridge import QLinear
from bridge.kernels import int8dyn
from bridge.modules import actquant
from bridge_util import w8a8_reference

NATIVE = int8dyn.native_reason() is None
native_only = pytest.mark.skipif(not NATIVE, reason=f"C++ routine unavailable: {int8dyn.native_reason()}")
MODES = [pytest.param(True, marks=native_only, id="native"), pytest.param(False, id="torch")]
NAME = "int8_dynamic_cpu"

TOKEN = qt.PerChannel(0)
SPECS = {  # the cases the fused path takes
    "asym": qt.QuantSpec(format="int8", granularity=TOKEN, dynamic=True, symmetric=False),  # w8a8-int8-dynamic
    "sym-full": qt.QuantSpec(format="int8", granularity=TOKEN, dynamic=True),  # scale amax / 127.5
    "sym-restricted": qt.QuantSpec(format="int8", granularity=TOKEN, dynamic=True, symmetric_range="restricted"),
}
OTHERS = {  # ... and ones it does not
    "per-tensor": qt.QuantSpec(format="int8", dynamic=True),
    "per-group": qt.QuantSpec(format="int8", granularity=qt.PerGroup(16), dynamic=True),
    "uint8": qt.QuantSpec(format="uint8", granularity=TOKEN, dynamic=True, symmetric=False),
    "int4": qt.QuantSpec(format="int4", granularity=TOKEN, dynamic=True),
    "stochastic": qt.QuantSpec(format="int8", granularity=TOKEN, dynamic=True, rounding="stochastic"),
    "half-away": qt.QuantSpec(format="int8", granularity=TOKEN, dynamic=True, rounding="half_away"),
    "bf16-scales": qt.QuantSpec(format="int8", granularity=TOKEN, dynamic=True, scale_dtype="bfloat16"),
    "pow2-scales": qt.QuantSpec(format="int8", granularity=TOKEN, dynamic=True, power_of_two=True),
    "float-zero": qt.QuantSpec(format="int8", granularity=TOKEN, dynamic=True, symmetric=False,
                               zero_point_domain="float"),
    "fp8": qt.QuantSpec(format="fp8_e4m3", granularity=TOKEN, dynamic=True),
}


def _wide(spec):
    """tensors_for's 2-D draws (zero, constant, subnormal and float32-limit rows) repeated along the
    features with per-feature factors in [-1, 1]: rows of 1 to 100 features (the C++ vector loops run
    16 and 8 at a time, then a scalar tail)."""
    @st.composite
    def draw(d):
        x = d(tensors_for(spec))
        reps = d(st.integers(1, 12))
        wide = x.repeat(1, reps)
        f = d(hnp.arrays(np.float32, (wide.shape[1],), elements=st.floats(-1, 1, width=32)))
        keep = d(st.booleans())  # keep the drawn rows themselves (the extremes) in the first columns
        f[: x.shape[1]] = 1.0 if keep else f[: x.shape[1]]
        return wide * torch.from_numpy(f)
    return draw()


def _general(x, spec):
    q = qt.quantize(x, qt.choose_qparams(x, spec))
    return q.codes, q.qparams.scale, q.qparams.zero_point


def _assert_same(got, want):
    assert got is not None
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("name", list(SPECS))
@given(data=st.data())
def test_codes_and_scales_equal_the_general_path(native, name, data):
    spec = SPECS[name]
    x = data.draw(_wide(spec))
    assert int8dyn.fused_reason(spec) is None
    _assert_same(int8dyn.token_quantize(x, spec, use_native=native), _general(x, spec))
    want = qt.fake_quantize(x, qt.choose_qparams(x, spec))
    assert torch.equal(int8dyn.token_fake_quantize(x, spec, use_native=native), want)


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("name", list(SPECS))
def test_hand_picked_rows(native, name):
    """Zero rows, one-sign rows, ties (x / scale at k + 0.5), float32's extremes, tiny values."""
    spec = SPECS[name]
    big = torch.finfo(torch.float32).max
    rows = [torch.zeros(40), torch.linspace(0.0, 3.0, 40), -torch.linspace(0.5, 7.0, 40),
            torch.cat([torch.arange(-20.0, 19.0) + 0.5, torch.tensor([127.5])]),  # sym-full: scale 1, ties
            torch.full((40,), 1e-40), torch.linspace(-1.0, 1.0, 40) * big,
            torch.linspace(-1e-30, 2e-38, 40), torch.tensor([255.0, -0.5] * 20)]
    for x in rows:
        x = x.reshape(1, -1)
        _assert_same(int8dyn.token_quantize(x, spec, use_native=native), _general(x, spec))
    x = torch.stack(rows)
    _assert_same(int8dyn.token_quantize(x, spec, use_native=native), _general(x, spec))
    # the asymmetric zero point of a one-signed row: [0, 3] has min 0 -> zero point -128
    if name == "asym":
        assert int(int8dyn.token_quantize(rows[1].reshape(1, -1), spec, use_native=native)[2]) == -128


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("name", list(SPECS))
def test_bfloat16_and_views(native, name):
    spec = SPECS[name]
    torch.manual_seed(3)
    x = (torch.randn(5, 72) * torch.logspace(-3, 3, 5).reshape(5, 1)).bfloat16()
    _assert_same(int8dyn.token_quantize(x, spec, use_native=native), _general(x, spec))
    y = int8dyn.token_fake_quantize(x, spec, use_native=native)
    assert y.dtype == torch.bfloat16 and torch.equal(y, qt.fake_quantize(x, qt.choose_qparams(x, spec)))
    xt = torch.randn(72, 5).t()  # a non-contiguous view
    _assert_same(int8dyn.token_quantize(xt, spec, use_native=native), _general(xt, spec))
    assert int8dyn.token_quantize(torch.zeros(0, 8), spec, use_native=native)[0].shape == (0, 8)


@pytest.mark.parametrize("native", MODES)
def test_non_finite_goes_to_the_general_path(native):
    spec = SPECS["asym"]
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3, 40)
        x[1, 37] = bad
        assert int8dyn.token_quantize(x, spec, use_native=native) is None
        assert int8dyn.token_fake_quantize(x, spec, use_native=native) is None
    m = torch.nn.Module()
    actquant.attach(m, "input", spec)
    with pytest.raises(ValueError):  # the general path's error
        actquant.apply(m, "input", x)


def test_fused_reason_chooses_exactly_these_specs():
    assert all(int8dyn.fused_reason(s) is None for s in SPECS.values())
    for name, s in OTHERS.items():
        assert int8dyn.fused_reason(s) is not None, name
    assert int8dyn.fused_reason(qt.QuantSpec(format="int8", granularity=TOKEN)) is not None  # static


def _module(xspec, *, wspec=None, n=48, k=96, seed=0, **kw):
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.05
    wspec = wspec or qt.QuantSpec(format="int8", granularity=TOKEN, symmetric_range="restricted")
    q = qt.quantize(w, qt.choose_qparams(w, wspec))
    return QLinear(q, torch.randn(n) * 0.1, input_quant=xspec, **kw)


@native_only
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("shape", [(1, 96), (3, 96), (2, 5, 96), (int8dyn.MAX_ROWS + 1, 96)],
                         ids=["1", "3", "2x5", "many"])
def test_kernel_matches_int_mm_and_the_reference(name, shape):
    spec = SPECS[name]
    m = _module(spec)
    assert m.kernel == NAME  # the automatic choice
    torch.manual_seed(4)
    x = torch.randn(*shape) * 3 + 0.5
    y = m(x)
    assert y.shape == (*shape[:-1], 48) and y.dtype == torch.float32
    y64, mag = w8a8_reference(m, x)
    b = m.bias.detach()
    ref = m.__class__(m.qweight, b, input_quant=spec, kernel="dequant")(x)  # the fake-quantized reference
    assert ((y - ref).abs() <= 2.0 ** -16 * mag + 1e-6).all()
    if x.numel() < int8dyn.MAX_ROWS * 96:  # the GEMV: exact sums; the conversion and two products round
        tol = 2.0 ** -21 * y64.abs() + 2.0 ** -22 * (y.abs() + b.abs()).double()
        assert ((y - b).double() - y64).abs().le(tol + 1e-30).all()
        assert torch.equal(y, _module(spec, kernel="int8_int_mm_cpu")(x))
    else:  # fake-quantize + F.linear on the dequantized weight: the dequant path's numbers
        assert torch.allclose(y, ref, rtol=0, atol=1e-6)


@native_only
def test_kernel_edges():
    m = _module(SPECS["asym"])
    assert m(torch.randn(0, 96)).shape == (0, 48) and m(torch.randn(2, 0, 96)).shape == (2, 0, 48)
    x = torch.randn(2, 96)
    x[0, 5] = float("nan")
    with pytest.raises(ValueError):
        m(x)
    m.to(torch.bfloat16)
    xb = torch.randn(3, 96).bfloat16()
    y = m(xb)
    assert y.dtype == torch.bfloat16
    y64, _ = w8a8_reference(m, xb)
    b = m.bias.double()
    assert ((y.double() - b - y64).abs() <= 2.0 ** -7 * (y64.abs() + b.abs())).all()


def test_kernel_not_chosen_for_other_specs():
    torch.manual_seed(1)
    static = qt.choose_qparams(torch.randn(16, 96), qt.QuantSpec(format="int8", symmetric=False))
    for name, xq in [*OTHERS.items(), ("static-per-tensor", static), ("none", None)]:
        m = _module(xq)
        assert m.kernel != NAME and NAME not in m.available_kernels(), name
    for wspec in (qt.QuantSpec(format="uint8", granularity=TOKEN),
                  qt.QuantSpec(format="int8", granularity=qt.PerGroup(32)),
                  qt.QuantSpec(format="int4", granularity=TOKEN)):
        assert NAME not in _module(SPECS["asym"], wspec=wspec).available_kernels(), wspec


def test_without_the_cpp_build(monkeypatch):
    """No C++ routine: the kernel is not chosen, the fused quantizer runs in torch ops, same numbers."""
    monkeypatch.setattr(int8dyn, "_build", lambda: (None, "disabled for the test"))
    spec = SPECS["asym"]
    m = _module(spec)
    assert m.kernel == "int8pack_cpu" and NAME not in m.available_kernels()
    torch.manual_seed(5)
    x = torch.randn(4, 96)
    _assert_same(int8dyn.token_quantize(x, spec), _general(x, spec))
    with pytest.raises(ValueError, match="cannot run"):
        int8dyn.token_quantize(x, spec, use_native=True)


def test_actquant_uses_it_with_the_same_results():
    spec = SPECS["asym"]
    m = _module(spec, kernel="dequant")
    torch.manual_seed(6)
    x = torch.randn(2, 3, 96) * 4
    qp = actquant.qparams_for(m, "input", x)
    want = qt.choose_qparams(x.reshape(-1, 96), spec)
    assert torch.equal(qp.scale, want.scale) and torch.equal(qp.zero_point, want.zero_point)
    assert torch.equal(actquant.apply(m, "input", x), qt.fake_quantize(x.reshape(-1, 96), want).reshape(x.shape))
    # a gradient through the input: the general path's straight-through estimator
    xg = x.clone().requires_grad_(True)
    actquant.apply(m, "input", xg).sum().backward()
    xr = x.reshape(-1, 96).clone().requires_grad_(True)
    qt.fake_quantize(xr, qt.choose_qparams(xr.detach(), spec)).sum().backward()
    assert torch.equal(xg.grad.reshape(-1, 96), xr.grad)


@native_only
def test_large_in_features_and_threads():
    """Thousands of features (several thread chunks) and a row count not a multiple of the 4-row tiles."""
    spec = SPECS["sym-full"]
    m = _module(spec, n=4099 - 3 * 1024, k=4096 + 8)
    torch.manual_seed(7)
    x = torch.randn(3, 4104)
    saved = int8dyn.PARALLEL_CHUNK
    try:
        int8dyn.PARALLEL_CHUNK = 1  # as many chunks as tiles
        y = m(x)
    finally:
        int8dyn.PARALLEL_CHUNK = saved
    assert torch.equal(y, m(x))
    assert torch.equal(y, _module(spec, n=4099 - 3 * 1024, k=4096 + 8, kernel="int8_int_mm_cpu")(x))
