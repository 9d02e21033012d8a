"""Edges of the quantized modules (issue 15): one meaning of an activation spec on every forward path,
``QConvTranspose2d(x, output_size=...)``, and GPT-2's ``Conv1D`` quantized in the logical (out, in)
layout like ``Linear``."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform as qt
import bridge
from bridge import QConvTranspose2d, QLinear
from bridge.modules import actquant
from bridge.kernels.fp8 import rowwise_scales
from bridge_util import same_bits, tiny_causal_lm

FP8 = next(n for n, f in qt.FORMATS.items() if f.codec.code_dtype == torch.float8_e4m3fn and f.block is None)
#: Row-wise _scaled_mm scales on CPU (torch 2.11's takes per-tensor ones only: fp8_scaled_mm refuses there).
ROWWISE, ROWWISE_REFUSED = rowwise_scales(torch.device("cpu")), "per-tensor scales only on cpu"


def qweight(w, spec):
    w = w.detach()
    return qt.quantize(w, qt.choose_qparams(w, spec))


def fp8_per_row(x2):
    """Independent fp8 e4m3 fake quantization of each row of a matrix: scale = row amax / 448."""
    scale = x2.abs().amax(dim=1, keepdim=True) / 448.0
    return (x2 / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * scale


def _tokens(seed=0, shape=(2, 16, 256)):
    torch.manual_seed(seed)
    # the tokens of one sequence differ in magnitude by 100x: per sequence and per token differ
    return torch.randn(*shape) * torch.logspace(-1, 1, shape[1])[None, :, None]


# ---------------------------------------------------------------------------- 1. per token, every path

@pytest.mark.parametrize("kernel", ["fp8_scaled_mm", "dequant"])
def test_per_channel0_activation_is_per_token_on_a_3d_input(kernel):
    torch.manual_seed(0)
    lin = nn.Linear(256, 64)
    q = qweight(lin.weight, qt.QuantSpec(format=FP8, granularity=qt.PerChannel(0)))
    inp = qt.QuantSpec(format=FP8, dynamic=True, granularity=qt.PerChannel(0))
    if kernel == "fp8_scaled_mm" and not ROWWISE:
        with pytest.raises(ValueError, match=ROWWISE_REFUSED):
            QLinear.from_float(lin, q, input_quant=inp, kernel=kernel)
        return
    m = QLinear.from_float(lin, q, input_quant=inp, kernel=kernel)
    x = _tokens()
    ref = F.linear(fp8_per_row(x.reshape(-1, 256)), qt.dequantize(q), lin.bias).reshape(2, 16, 64)
    with torch.no_grad():
        y = m(x)
    err = ((y - ref).norm() / ref.norm()).item()
    assert err < 4e-3, err  # per batch element would be ~3e-2 away
    # per token: a token's output does not depend on the other tokens of its sequence
    with torch.no_grad():
        alone = torch.stack([m(x[b, t][None])[0] for b in range(2) for t in range(16)]).reshape(2, 16, 64)
    torch.testing.assert_close(y, alone, rtol=0, atol=(1e-5 if kernel == "dequant" else 1e-2) * ref.abs().max().item())


def test_fp8_and_dequant_paths_agree_on_3d_inputs():
    torch.manual_seed(1)
    lin = nn.Linear(256, 64)
    q = qweight(lin.weight, qt.QuantSpec(format=FP8, granularity=qt.PerChannel(0)))
    for gran in (qt.PerChannel(0), qt.PerTensor()):
        inp = qt.QuantSpec(format=FP8, dynamic=True, granularity=gran)
        if not ROWWISE:  # per-channel weight scales: row-wise
            with pytest.raises(ValueError, match=ROWWISE_REFUSED):
                QLinear.from_float(lin, q, input_quant=inp, kernel="fp8_scaled_mm")
            continue
        fast = QLinear.from_float(lin, q, input_quant=inp, kernel="fp8_scaled_mm")
        ref = QLinear.from_float(lin, q, input_quant=inp, kernel="dequant")
        x = _tokens(2, (3, 8, 256))
        with torch.no_grad():
            a, b = fast(x), ref(x)
        assert ((a - b).norm() / b.norm()).item() < 4e-3, gran
        # both paths take their input scales from the one function that defines the view
        x2 = actquant.activation_view(fast, x)
        assert x2.shape == (24, 256)
        s, _ = fast.input_qparams(x).effective()
        assert s.shape == ((24, 1) if gran == qt.PerChannel(0) else (1, 1))
        torch.testing.assert_close(s, (x2.abs().amax(dim=1, keepdim=True) if gran == qt.PerChannel(0)
                                       else x2.abs().amax().reshape(1, 1)) / 448.0)


def test_int8_output_quantizer_is_per_token_too():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = qweight(lin.weight, qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)))
    m = QLinear.from_float(lin, q, kernel="dequant", output_quant=qt.QuantSpec(format="int8", dynamic=True,
                                                                            granularity=qt.PerChannel(0)))
    x = _tokens(3, (2, 5, 64))
    y = F.linear(x, qt.dequantize(q), lin.bias)
    # independent: symmetric int8 ("full" range: amax over (qmax - qmin) / 2 = 127.5 steps), one scale per token
    s = y.abs().amax(dim=-1, keepdim=True) / 127.5
    want = torch.clamp(torch.round(y / s), -128, 127) * s
    with torch.no_grad():
        torch.testing.assert_close(m(x), want, rtol=0, atol=1e-5)


def test_static_activation_qparams_of_a_3d_observation():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = qweight(lin.weight, qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)))
    x = _tokens(4, (2, 5, 64))
    spec = qt.QuantSpec(format="uint8", symmetric=False)
    per_tensor = qt.choose_qparams(x, spec)  # scale shape (1, 1, 1): one scale for every token
    m = QLinear.from_float(lin, q, kernel="dequant", input_quant=per_tensor)
    lo, hi = x.min(), x.max()
    s = (hi - lo) / 255.0
    z = torch.round(-lo / s)
    xq = (torch.clamp(torch.round(x / s) + z, 0, 255) - z) * s
    with torch.no_grad():
        torch.testing.assert_close(m(x), F.linear(xq, qt.dequantize(q), lin.bias), rtol=1e-5, atol=1e-5)
    per_feature = qt.choose_qparams(x, qt.QuantSpec(format="int8", granularity=qt.PerChannel(-1)))  # (1, 1, 64)
    m2 = QLinear.from_float(lin, q, kernel="dequant", input_quant=per_feature)
    x2 = x.reshape(-1, 64)
    sf = x2.abs().amax(dim=0) / 127.5
    with torch.no_grad():
        torch.testing.assert_close(m2(x), F.linear(torch.clamp(torch.round(x / sf), -128, 127) * sf,
                                                   qt.dequantize(q), lin.bias), rtol=1e-5, atol=1e-5)
    per_sequence = qt.choose_qparams(x, qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)))  # (2, 1, 1)
    with pytest.raises(ValueError, match=r"input_quant: .*\(tokens, features\).*shape \(2, 1, 1\)"):
        QLinear.from_float(lin, q, input_quant=per_sequence)


# ---------------------------------------------------------------------------- 2. ConvTranspose2d output_size

def test_conv_transpose_output_size_keyword_like_torch():
    torch.manual_seed(0)
    up = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1)
    q = qweight(up.weight, qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)))
    m = QConvTranspose2d.from_float(up, q)
    ref = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1)
    with torch.no_grad():
        ref.weight.copy_(qt.dequantize(q))
        ref.bias.copy_(up.bias)
    x = torch.randn(2, 8, 5, 5)
    with torch.no_grad():
        for size in [(10, 10), (9, 10), [2, 4, 10, 9], torch.Size([10, 10])]:
            want = ref(x, output_size=size)
            torch.testing.assert_close(m(x, output_size=size), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(m(x, size), want, rtol=1e-5, atol=1e-5)  # positional, as torch takes it
        assert m(x).shape == ref(x).shape == (2, 4, 9, 9)
        torch.testing.assert_close(m(x[0], output_size=(10, 10)), ref(x[0], output_size=(10, 10)), rtol=1e-5,
                                   atol=1e-5)  # unbatched
    with pytest.raises(ValueError, match=r"output_size \[20, 20\]: requested an output size"):
        m(x, output_size=(20, 20))  # out of reach
    with pytest.raises(ValueError, match=r"output_size \[10\]"):
        m(x, output_size=[10])
    with pytest.raises(TypeError, match="output_size must be None or a list/tuple of ints"):
        m(x, output_size=10)


# ---------------------------------------------------------------------------- 3. Conv1D: logical (out, in)

def _conv1d_model(nx=64, nf=48, seed=0):
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(seed)
    model = nn.ModuleDict({"c": Conv1D(nf, nx)})  # weight (in=nx, out=nf)
    with torch.no_grad():  # output columns of very different magnitudes: per input / per output differ
        model["c"].weight.mul_(torch.logspace(-2, 1, nf)[None, :])
    return model


def test_conv1d_per_channel0_is_per_output_feature():
    model = _conv1d_model()
    w = model["c"].weight.detach()  # (in=64, out=48)
    qm = bridge.quantize(model, qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int8",
                                                                               granularity=qt.PerChannel(0))}))
    c = qm["c"]
    assert isinstance(c, QLinear) and (c.in_features, c.out_features) == (64, 48)
    s, _ = c.qweight.qparams.effective()
    assert s.numel() == w.shape[1] == 48
    torch.testing.assert_close(s.reshape(-1), w.abs().amax(dim=0) / 127.5)  # one scale per output column
    logical = c.dequantized_weight().t()  # (out, in)
    assert logical.shape == (48, 64)
    assert (logical - w.t()).abs().le(w.abs().amax(dim=0)[:, None] / 254 * 1.0001).all()
    x = torch.randn(3, 7, 64)
    with torch.no_grad():
        torch.testing.assert_close(c(x), F.linear(x, logical, model["c"].bias), rtol=1e-5, atol=1e-5)


def test_conv1d_groups_run_along_in_features():
    model = _conv1d_model()
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
    c = bridge.quantize(model, spec)["c"]
    lin = nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(model["c"].weight.t())
    want = qt.dequantize(qweight(lin.weight, spec))  # the same weight as a Linear: (out, in), groups along in
    torch.testing.assert_close(c.dequantized_weight().t(), want, rtol=0, atol=0)
    assert c.qweight.qparams.scale.numel() == 48 * 2


def test_linear_type_rule_selects_conv1d_and_conv1d_rule_wins():
    model = tiny_causal_lm("gpt2").eval()
    s8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    s4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
    p = bridge.plan(model, qt.Recipe(type_rules={"Linear": s8}, exclude=["lm_head*"]))
    conv1d = [n + ".weight" for n, m in model.named_modules() if bridge.modules.is_conv1d(m)]
    assert len(conv1d) == 8 and list(p.specs) == conv1d
    assert {p[k].rule for k in conv1d} == {"type_rules[Linear]"} and {p[k].module_type for k in conv1d} == {"Conv1D"}
    both = bridge.plan(model, qt.Recipe(type_rules={"Linear": s8, "Conv1D": s4}))
    assert {both[k].rule for k in conv1d} == {"type_rules[Conv1D]"} and both["lm_head.weight"].rule == "type_rules[Linear]"
    off = bridge.plan(model, qt.Recipe(type_rules={"Linear": s8, "Conv1D": None}))
    assert list(off.specs) == ["lm_head.weight"]


@pytest.mark.parametrize("name", sorted(qt.presets()))
def test_every_preset_quantizes_gpt2_conv1d_per_output_row(name):
    model = tiny_causal_lm("gpt2").eval()
    calibration = [torch.randint(0, 128, (1, 8))]  # for the presets with static activation scales
    if any(s.name in ("rotate", "spinquant") for s in qt.get_preset(name).steps):  # LayerNorm: no rotation
        with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(gpt2\) normalises with LayerNorm"):
            bridge.quantize(model, qt.get_preset(name).recipe, calibration=calibration)
        return
    qm = bridge.quantize(model, qt.get_preset(name).recipe, kernel="dequant", calibration=calibration)
    ids = torch.randint(0, 128, (1, 6))
    c = qm.transformer.h[0].mlp.c_fc
    assert isinstance(c, QLinear) and c.transposed
    logical = c.dequantized_weight().t()  # (out=256, in=64)
    ref = model.transformer.h[0].mlp.c_fc.weight.detach().t()
    steps = qt.get_preset(name).steps
    if all(qt.ALGORITHMS[s.name].needs is None for s in steps):  # smoothquant first changes the weights
        # the same preset on the logical weight as a plain tensor: the very same grid
        want = qt.dequantize_tree(qt.quantize_tree({"w": ref}, qt.Recipe(default=qt.get_preset(name).spec,
                                                                           steps=steps)))["w"]
        torch.testing.assert_close(logical, want.to(logical.dtype), rtol=0, atol=0)
    else:  # one scale per output row of the logical (out, in) weight, as for every preset
        assert c.qweight.qparams.scale.shape == (1, 256)
    with torch.no_grad():
        assert torch.isfinite(qm(ids).logits).all()


def test_gpt2_save_from_pretrained_and_load_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2").eval()
    recipe = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))},
                       exclude=["lm_head*"])
    qm = bridge.quantize(model, recipe)
    c = qm.transformer.h[1].attn.c_attn
    assert c.qweight.qparams.scale.numel() == model.transformer.h[1].attn.c_attn.weight.shape[1] == 192
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        ref = qm(ids).logits
    bridge.save(qm, tmp_path / "ck")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    like = tiny_causal_lm("gpt2").eval()
    again = bridge.load(tmp_path / "ck", like=like).eval()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref) and torch.equal(again(ids).logits, ref)
    for (k, a), b in zip(qm.state_dict().items(), back.state_dict().values()):
        assert same_bits(a, b), k
    cfg = bridge.QTransformConfig(recipe=recipe, skip_modules=[])  # quantize on load: the same grid
    model.save_pretrained(tmp_path / "fp")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=cfg).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)


def test_conv1d_spec_that_does_not_fit_names_the_logical_layout():
    model = _conv1d_model()
    with pytest.raises(ValueError, match=r"c.weight: recipe default .*group size 40 does not divide axis -1 of size "
                                         r"64.*stored \(in, out\) = \(64, 48\).*\(out, in\) layout \(48, 64\)"):
        bridge.quantize(model, qt.QuantSpec(format="int4", granularity=qt.PerGroup(40)))
    assert not isinstance(model["c"], QLinear)
