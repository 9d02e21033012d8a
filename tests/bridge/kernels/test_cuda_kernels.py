"""The CUDA kernels (``int4pack_cuda``, ``int8_int_mm_cuda``, ``fp8_scaled_mm``) against the dequantize
reference, with tolerances derived from each kernel's rounding; the parts that run anywhere (packing
helpers, eligibility reasons, the error bounds checked on the CPU kernels) run here too.
The tests marked ``cuda`` run on a GPU machine (``make test-gpu``)."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform as qt
from bridge import QLinear, kernels
from bridge.kernels import cuda as kcuda, int4, int8mm
from bridge_util import w8a8_reference

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device here (make test-gpu on a GPU machine)")
FP8 = next(n for n, f in qt.FORMATS.items() if f.codec.code_dtype == torch.float8_e4m3fn and f.block is None)
U = 2.0 ** -8  # bf16 unit roundoff (8 significant bits: relative error <= 2^-8 per rounding)

INT4_SPECS = [qt.QuantSpec(format="int4", granularity=qt.PerGroup(128)),
              qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False),
              qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="offset"),
              qt.QuantSpec(format="int4", granularity=qt.PerChannel(0)),
              qt.QuantSpec(format="uint3", granularity=qt.PerGroup(64), symmetric=False, zero_point_domain="float")]
W8A8_INT8 = (qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)),
             qt.QuantSpec(format="int8", dynamic=True, granularity=qt.PerChannel(0), symmetric=False))


def make(spec, n=64, k=256, seed=0, **kw):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=False)
    w = lin.weight.detach()
    return QLinear.from_float(lin, qt.quantize(w, qt.choose_qparams(w, spec)), **kw)


def int4_bound(x, q, ref):
    """Largest ``|kernel(x) - F.linear(x, dequantize(q))|`` for a bf16 int4 kernel (elementwise), from its
    roundings (unit roundoff ``U``): each weight is ``(u - 8) * scale + zero`` with scale and zero rounded
    to bf16 and one bf16 FMA (``<= 2U (|u - 8| |scale| + |zero|)``); activations rounded to bf16 (``U |x|``);
    fp32 sums of K products (``K 2^-24``); the output rounded to bf16 (``U`` of it)."""
    n, k = q.shape
    group = int4.int4_group(k, q.spec.granularity.block_size((n, k))[-1])
    sz = int4.scale_and_zeros(q, group).float()
    s, z = (sz[..., i].t().repeat_interleave(group, dim=1) for i in (0, 1))
    u = int4.nibbles(q).float()
    w = qt.dequantize(q).float()
    ax = x.float().abs().reshape(-1, k)
    e = ax @ (2 * U * ((u - 8).abs() * s.abs() + z.abs())).t() + (U * ax) @ w.abs().t()
    e = e + k * 2.0 ** -24 * (ax @ w.abs().t())
    return (e + U * (ref.abs().reshape(-1, n) + e)).reshape(ref.shape)


# ---------------------------------------------------------------------------- anywhere

def test_pack_nibble_pairs_puts_the_even_element_high():
    u = torch.randint(0, 16, (8, 64))
    p = int4.pack_nibble_pairs(u)
    assert p.dtype == torch.uint8 and p.shape == (8, 32)
    assert torch.equal((p >> 4).long(), u[:, 0::2]) and torch.equal((p & 15).long(), u[:, 1::2])


@pytest.mark.parametrize("spec", INT4_SPECS, ids=str)
def test_the_cuda_operands_decode_to_the_weight(spec):
    """What ``int4pack_cuda`` hands ``_convert_weight_to_int4pack`` and ``_weight_int4pack_mm``, decoded the
    way int4mm.cu does (high nibble = even k; ``(u - 8) * scale + zero`` per group), is the weight to bf16."""
    m = make(spec)
    q = m.qweight
    n, k = q.shape
    group = int4.int4_group(k, spec.granularity.block_size((n, k))[-1])
    p = int4.pack_nibble_pairs(int4.nibbles(q))
    u = torch.stack([p >> 4, p & 15], dim=-1).reshape(n, k).float()
    sz = int4.scale_and_zeros(q, group).float()  # (k / group, n, 2)
    assert sz.shape == (k // group, n, 2)
    s, z = (sz[..., i].t().repeat_interleave(group, dim=1) for i in (0, 1))
    w = qt.dequantize(q)
    assert ((u - 8) * s + z - w).abs().le(U * ((u - 8).abs() * s.abs() + z.abs()) + 1e-12).all()


def test_inner_k_tiles():
    assert [kcuda.inner_k_tiles(k) for k in (4096, 576, 96, 32, 48)] == [8, 4, 2, 2, None]


@pytest.mark.parametrize("spec", INT4_SPECS, ids=str)
def test_the_int4_bound_holds_for_the_cpu_kernel(spec, monkeypatch):
    """The bound the CUDA test uses, checked on the CPU int4pack kernel (same operands, same bf16 math)."""
    monkeypatch.setattr(kernels.decode, "DECODE_MAX_ROWS", 0)  # the aten kernel, not the AVX2 GEMV
    m = make(spec)
    assert m.kernel == "int4pack_cpu"
    x = torch.randn(5, 256)
    ref = F.linear(x, qt.dequantize(m.qweight))
    assert ((m(x) - ref).abs() <= int4_bound(x, m.qweight, ref)).all()


class _OnCuda:
    """A CPU module seen as if it lived on a CUDA device of a given capability (for the checks only)."""

    def __init__(self, m):
        self._m = m
        self.weight = types.SimpleNamespace(device=torch.device("cuda", 0))

    def __getattr__(self, name):
        return getattr(self._m, name)


@pytest.mark.parametrize("cap", [(9, 0), (7, 5)])
def test_cuda_eligibility_reasons(cap, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: cap)
    ok = cap >= (8, 0)
    table = kernels.LINEAR_KERNELS
    m = _OnCuda(make(INT4_SPECS[0]))
    assert (table["int4pack_cuda"].check(m, False) is None) == ok
    assert table["int4pack_cpu"].check(m, False) == "not on CPU"
    assert table["int8_int_mm_cuda"].check(m, False).startswith("weight codes are not 8-bit")
    w8a8 = _OnCuda(make(W8A8_INT8[0], input_quant=W8A8_INT8[1]))
    assert (table["int8_int_mm_cuda"].check(w8a8, False) is None) == ok
    assert table["int8_int_mm_cpu"].check(w8a8, False) == "not on CPU"
    weight_only = _OnCuda(make(W8A8_INT8[0]))
    assert "no input quantizer" in table["int8_int_mm_cuda"].check(weight_only, False)
    if not ok:
        assert "compute capability >= 8.0" in table["int4pack_cuda"].check(m, False)
        return
    assert "multiple of 8" in table["int4pack_cuda"].check(_OnCuda(make(INT4_SPECS[0], n=60, k=256)), False)
    assert "scale grid" in table["int4pack_cuda"].check(_OnCuda(make(INT4_SPECS[3], n=64, k=48)), False)
    assert "group" in table["int4pack_cuda"].check(_OnCuda(make(qt.QuantSpec(format="int4", granularity=qt.PerGroup(16)))), False)
    odd = _OnCuda(make(W8A8_INT8[0], n=60, input_quant=W8A8_INT8[1]))
    assert "multiples of 8" in table["int8_int_mm_cuda"].check(odd, False)


def test_cuda_kernels_refused_on_cpu_by_reason():
    m = make(INT4_SPECS[0])
    assert "int4pack_cuda" not in m.available_kernels()
    with pytest.raises(ValueError, match="int4pack_cuda.*not on CUDA"):
        m.kernel = "int4pack_cuda"
    w8a8 = make(W8A8_INT8[0], input_quant=W8A8_INT8[1])
    with pytest.raises(ValueError, match="int8_int_mm_cuda.*not on CUDA"):
        w8a8.kernel = "int8_int_mm_cuda"


@pytest.mark.cuda  # needs no GPU, only a CUDA build of torch: `make test-gpu` runs it too
@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a CPU-only torch build makes no fake CUDA tensors")
@pytest.mark.parametrize("name", ["int4pack_cuda", "int8_int_mm_cuda", "fp8_scaled_mm-channel", "fp8_scaled_mm-tensor"])
def test_cuda_paths_pass_torch_shape_checks_on_fake_cuda_tensors(name, monkeypatch):
    """No GPU needed: each CUDA path's prepare and run on fake CUDA tensors (``FakeTensorMode``), so torch's
    meta functions of ``_convert_weight_to_int4pack``, ``_weight_int4pack_mm``, ``_int_mm`` and
    ``_scaled_mm`` check the operands' dtypes, shapes and strides (``b`` column-major for ``_scaled_mm``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kernel, _, gran = name.partition("-")
    if kernel == "int4pack_cuda":
        m = make(INT4_SPECS[1])
    elif kernel == "int8_int_mm_cuda":
        m = make(W8A8_INT8[0], input_quant=W8A8_INT8[1])
    else:
        g = qt.PerChannel(0) if gran == "channel" else qt.PerTensor()
        m = make(qt.QuantSpec(format=FP8, granularity=g), input_quant=qt.QuantSpec(format=FP8, dynamic=True, granularity=g))
    k = kernels.LINEAR_KERNELS[kernel]
    # the data-dependent validations (finite scales...) skip themselves while tracing: fake tensors have no data
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        m._apply(lambda t: t.to("cuda"))
        st = {} if k.prepare is None else k.prepare(m)
        for rows in (1, 5, 40):
            y = k.run(m, st, torch.empty(2, rows, 256, device="cuda"))
            assert y.shape == (2, rows, 64) and y.dtype == torch.float32 and y.device.type == "cuda"


def test_int_mm_row_padding_is_cut_off():
    torch.manual_seed(0)
    a = torch.randint(-128, 128, (3, 64), dtype=torch.int8)
    b = torch.randint(-128, 128, (16, 64), dtype=torch.int8)
    sa, za, sb = torch.rand(3, 1), torch.randint(-5, 5, (3, 1)).float(), torch.rand(16, 1)
    y = int8mm.int8_int_mm_linear(a, sa, za, b, sb, min_rows=int8mm.CUDA_MIN_ROWS)
    assert y.shape == (3, 16) and torch.equal(y, int8mm.int8_int_mm_linear(a, sa, za, b, sb))


# ---------------------------------------------------------------------------- on a GPU

@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("spec", INT4_SPECS, ids=str)
@pytest.mark.parametrize("rows,prefill", [(1, None), (7, None), (64, None), (64, 32)])
def test_int4pack_cuda_matches_reference(spec, rows, prefill, monkeypatch):
    """``prefill``: from that many rows on, the dequantize + ``F.linear`` path (dense.PREFILL_ROWS)."""
    monkeypatch.setitem(kernels.dense.PREFILL_ROWS, "int4pack_cuda", prefill)
    m = make(spec).to("cuda")
    if torch.cuda.get_device_capability() < kcuda.MIN_CAPABILITY:
        pytest.skip("compute capability < 8.0")
    assert m.kernel == "int4pack_cuda"
    x = torch.randn(rows, 256, device="cuda")
    ref = F.linear(x.double(), qt.dequantize(m.qweight).double()).float()
    y = m(x)
    assert y.dtype == x.dtype and y.shape == (rows, 64)
    assert ((y - ref).abs() <= int4_bound(x, m.qweight, ref)).all()
    yb = m(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    xb = x.bfloat16().float()
    refb = F.linear(xb.double(), qt.dequantize(m.qweight).double()).float()
    assert ((yb.float() - refb).abs() <= int4_bound(xb, m.qweight, refb)).all()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_int8_int_mm_cuda_matches_exact_w8a8(rows):
    """Exact int32 sums: only the int32 -> float conversion and the two rescaling products round (2^-24 each,
    with the input quantizer's own float ops on the same device); fewer than 17 rows are padded."""
    m = make(W8A8_INT8[0], input_quant=W8A8_INT8[1]).to("cuda")
    if torch.cuda.get_device_capability() < int8mm.CUDA_MIN_CAPABILITY:
        pytest.skip("compute capability < 8.0")
    assert m.kernel == "int8_int_mm_cuda"
    x = torch.randn(rows, 256, device="cuda") * 2 + 0.5
    y = m(x)
    y64, _ = w8a8_reference(m, x)
    assert ((y.double() - y64).abs() <= 2.0 ** -21 * y64.abs() + 1e-30).all()
    ref = F.linear(qt.fake_quantize(x, m.input_qparams(x)), qt.dequantize(m.qweight))
    m.kernel = "dequant"
    torch.testing.assert_close(m(x), ref)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("gran", [qt.PerTensor(), qt.PerChannel(0)], ids=str)
def test_fp8_scaled_mm_matches_fake_quant_reference(gran):
    """fp8 codes multiply exactly; Hopper's fp8 tensor cores accumulate with about 14 bits between fp32
    promotions (DeepSeek-V3 report, 3.3.2), hence 2^-13 of the magnitude sum; row-wise scales give a bf16
    output (U of it)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    m = make(qt.QuantSpec(format=FP8, granularity=gran),
             input_quant=qt.QuantSpec(format=FP8, dynamic=True, granularity=gran)).to("cuda")
    assert m.kernel == "fp8_scaled_mm"
    x = torch.randn(3, 5, 256, device="cuda")
    y = m(x)
    y64, mag = w8a8_reference(m, x)
    assert ((y.double() - y64).abs() <= 2.0 ** -13 * mag + U * y64.abs()).all()


@cuda
@pytest.mark.cuda
def test_auto_choice_on_cuda_and_back_on_cpu():
    m4 = make(INT4_SPECS[0])
    w8a8 = make(W8A8_INT8[0], input_quant=W8A8_INT8[1])
    w8 = make(W8A8_INT8[0])  # int8 weight-only: no CUDA kernel, the dequant reference
    odd = make(INT4_SPECS[3], k=48)  # in_features not a multiple of a kernel group
    # on the CPU the W8A8 module runs the weight-only int8pack kernel after fake-quantizing its input
    assert (m4.kernel, w8a8.kernel, w8.kernel) == ("int4pack_cpu", "int8pack_cpu", "int8pack_cpu")
    for m in (m4, w8a8, w8, odd):
        m.to("cuda")
    assert (m4.kernel, w8a8.kernel, w8.kernel, odd.kernel) == ("int4pack_cuda", "int8_int_mm_cuda", "dequant", "dequant")
    x = torch.randn(2, 256, device="cuda")
    assert m4(x).device.type == "cuda" and w8(x).device.type == "cuda"
    m4.to("cpu")
    assert m4.kernel == "int4pack_cpu" and m4(x.cpu()).device.type == "cpu"
