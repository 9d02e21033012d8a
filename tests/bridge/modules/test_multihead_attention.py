"""``nn.MultiheadAttention`` quantized (issue 53): ``QMultiheadAttention`` computes torch's attention on the
dequantized weights in every mode, inside ``nn.TransformerEncoder``/``Decoder`` (whose fused paths read weights as
tensors), with activation quantizers, through save/load, and recipes select or refuse its tensors by name.

Expected values come from torch's own ``nn.MultiheadAttention`` / encoder holding the dequantized weights."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform as qt
import bridge
from bridge import QLinear
from bridge.modules import QMultiheadAttention
from bridge.modules.actquant import activation_specs

INT8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
PRESETS = qt.presets()


class Holder(nn.Module):
    """An attention module called with query, key and value (cross-attention when ``mem`` is given)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x, mem=None, **kw):
        mem = x if mem is None else mem
        return self.attn(x, mem, mem, **kw)


def dequantized_twin(float_model, qmodel):
    """``float_model`` (a copy) holding the dequantized weights of ``qmodel``."""
    ref = copy.deepcopy(float_model)
    state = {p: qt.dequantize(v) if isinstance(v, qt.QTensor) else v for p, v in bridge.extract(qmodel).items()}
    ref.load_state_dict({k: state[k] for k in ref.state_dict()})
    return ref


def torch_slow(module, *args, **kw):
    """torch's own non-fused path (parameters requiring grad make every fast path step aside)."""
    with torch.enable_grad():
        out = module(*args, **kw)
    return out.detach() if isinstance(out, torch.Tensor) else tuple(o if o is None else o.detach() for o in out)


def mha(**kw):
    torch.manual_seed(0)
    return nn.MultiheadAttention(8, 2, **kw).eval()


MODES = {"packed": {}, "kdim_vdim": {"kdim": 6, "vdim": 5}, "no_bias": {"bias": False},
         "bias_kv": {"add_bias_kv": True}, "zero_attn": {"add_zero_attn": True}, "batch_first": {"batch_first": True}}


@pytest.mark.parametrize("mode", list(MODES))
def test_quantized_mha_equals_torch_on_dequantized_weights(mode):
    m = mha(**MODES[mode])
    q = bridge.quantize(Holder(m), INT8, kernel="dequant")
    assert isinstance(q.attn, QMultiheadAttention) and isinstance(q.attn.out_proj, QLinear)
    names = ("q_proj_weight", "k_proj_weight", "v_proj_weight") if mode == "kdim_vdim" else ("in_proj_weight",)
    assert q.attn.quantized_names == names
    ref = dequantized_twin(m, q.attn)
    bf = m.batch_first
    L, S, N = 4, 3, 2
    torch.manual_seed(1)
    x = torch.randn((N, L, 8) if bf else (L, N, 8))
    k = torch.randn((N, S, m.kdim) if bf else (S, N, m.kdim))
    v = torch.randn((N, S, m.vdim) if bf else (S, N, m.vdim))
    kpm = torch.tensor([[False, False, True], [False, True, True]])
    am = torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
    calls = [((x, k, v), {}), ((x, k, v), {"key_padding_mask": kpm}), ((x, k, v), {"attn_mask": am}),
             ((x, k, v), {"attn_mask": am.float() * -1e4, "key_padding_mask": kpm.float() * -1e4})]
    if mode != "kdim_vdim":
        causal = torch.triu(torch.full((L, L), float("-inf")), 1)
        calls += [((x, x, x), {}), ((x, k, k), {}), ((x, x, x), {"attn_mask": causal, "is_causal": True})]
        calls += [((x[0] if bf else x[:, 0],) * 3, {})]  # unbatched
    for (args, kw), nw, avg in itertools.product(calls, (True, False), (True, False)):
        want = torch_slow(ref, *args, need_weights=nw, average_attn_weights=avg, **kw)
        with torch.no_grad():
            got = q.attn(*args, need_weights=nw, average_attn_weights=avg, **kw)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5, msg=f"{mode} {list(kw)} {nw} {avg}")
        assert (got[1] is None) == (want[1] is None)
        if want[1] is not None:
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("preset", ["int8-channel", "w8a8-int8"])
def test_transformer_encoder_runs_quantized_and_reloads(batch_first, preset, tmp_path):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=batch_first).eval()
    x = torch.randn((2, 5, 16) if batch_first else (5, 2, 16))
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    recipe = PRESETS[preset].recipe
    q = bridge.quantize(enc, recipe, calibration=[x] if recipe.input is not None else None, kernel="dequant")
    res = bridge.quantize_params(enc, recipe, calibration=[x] if recipe.input is not None else None)
    for i in range(2):
        assert res.plan[f"layers.{i}.self_attn.in_proj_weight"].spec is not None
        assert res.plan[f"layers.{i}.self_attn.out_proj.weight"].spec is not None
        assert isinstance(res.qtree[f"layers.{i}.self_attn.in_proj_weight"], qt.QTensor)
    assert isinstance(q.layers[0].self_attn, QMultiheadAttention)
    with torch.no_grad():  # the encoder's and layer's fused paths would read the integer codes
        outs = [q(x), q(x, src_key_padding_mask=kpm)]
    if recipe.input is None:  # weight-only: torch's own encoder on the dequantized weights
        ref = dequantized_twin(enc, q)
        torch.testing.assert_close(outs[0], torch_slow(ref, x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1], torch_slow(ref, x, src_key_padding_mask=kpm), atol=1e-5, rtol=1e-5)
    else:
        sites = activation_specs(q)
        assert qt.Site("layers.0.self_attn", "input") in sites and qt.Site("layers.0.self_attn.out_proj", "input") in sites
        want = qt.choose_qparams(x, recipe.input).scale  # layer 0's attention sees the encoder's input
        torch.testing.assert_close(q.layers[0].self_attn.input_scale.reshape(()), want.reshape(()))
    bridge.save(q, tmp_path / "ckpt")
    back = bridge.load(tmp_path / "ckpt", like=enc, kernel="dequant")
    assert isinstance(back.layers[1].self_attn, QMultiheadAttention)
    with torch.no_grad():
        assert torch.equal(back(x), outs[0]) and torch.equal(back(x, src_key_padding_mask=kpm), outs[1])


def test_transformer_decoder_cross_attention_quantized():
    torch.manual_seed(0)
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1).eval()
    tgt, mem = torch.randn(2, 4, 16), torch.randn(2, 6, 16)
    q = bridge.quantize(dec, PRESETS["int8-channel"].recipe, kernel="dequant")
    assert isinstance(q.layers[0].multihead_attn, QMultiheadAttention)
    ref = dequantized_twin(dec, q)
    with torch.no_grad():
        got = q(tgt, mem)
    torch.testing.assert_close(got, torch_slow(ref, tgt, mem), atol=1e-5, rtol=1e-5)


def test_static_input_covers_query_key_value_and_out_proj_input():
    """Cross-attention: the one static input quantizer is calibrated on query, key and value; the out-projection's
    input on what enters it (torch never calls it: calibration runs a view that does)."""
    m = mha(kdim=6, vdim=6)
    torch.manual_seed(2)
    x, mem = torch.randn(3, 2, 8), 5 * torch.randn(4, 2, 6)
    spec = qt.QuantSpec(format="int8")  # static, per tensor
    recipe = qt.Recipe(type_rules={"MultiheadAttention": INT8}, input=spec)
    q = bridge.quantize(Holder(m), recipe, calibration=[(x, mem)], kernel="dequant")
    want = qt.choose_qparams(torch.cat([x.flatten(), mem.flatten()]), spec)
    torch.testing.assert_close(q.attn.input_scale.reshape(()), want.scale.reshape(()))
    # the reference: torch's attention on the fake-quantized inputs with an identity out-projection, then the
    # out-projection on its fake-quantized input
    ref = dequantized_twin(m, q.attn)
    w_out, b_out = ref.out_proj.weight.detach().clone(), ref.out_proj.bias.detach().clone()
    with torch.no_grad():
        ref.out_proj.weight.copy_(torch.eye(8))
        ref.out_proj.bias.zero_()
    per_row = qt.QParams(spec=spec, scale=want.scale.reshape(1, 1))

    def fq(t):
        return qt.fake_quantize(t.reshape(-1, t.shape[-1]), per_row).reshape(t.shape)

    inner = torch_slow(ref, fq(x), fq(mem), fq(mem), need_weights=False)[0]
    out_qp = qt.QParams(spec=spec, scale=q.attn.out_proj.input_scale.reshape(1, 1))
    expected = F.linear(qt.fake_quantize(inner.reshape(-1, 8), out_qp), w_out, b_out).reshape(inner.shape)
    with torch.no_grad():
        got = q(x, mem, need_weights=False)[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # calibrated as every site is: in one pass with the weights quantized, the activations not yet
    inner_max = torch_slow(ref, x, mem, mem, need_weights=False)[0].abs().max()
    torch.testing.assert_close(q.attn.out_proj.input_scale.reshape(()),
                               qt.choose_qparams(inner_max.reshape(1), spec).scale.reshape(()))


def test_dynamic_input_per_token():
    m = mha()
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True)  # per token
    q = bridge.quantize(Holder(m), qt.Recipe(type_rules={"MultiheadAttention": INT8}, act_rules={"attn:input": spec}),
                        kernel="dequant")
    assert q.attn.input_spec == spec and q.attn.out_proj.input_spec is None
    ref = dequantized_twin(m, q.attn)
    x = torch.randn(3, 2, 8)
    fx = qt.fake_quantize(x.reshape(-1, 8), qt.choose_qparams(x.reshape(-1, 8), spec)).reshape(x.shape)
    with torch.no_grad():
        got = q(x)
    want = torch_slow(ref, fx, fx, fx)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


def test_recipe_selection_by_glob_and_type():
    m = mha(add_bias_kv=True)
    p = bridge.plan(Holder(m), qt.Recipe(rules={"*.in_proj_weight": INT8}))
    assert p["attn.in_proj_weight"].spec is not None and p["attn.out_proj.weight"].spec is None
    q = bridge.quantize(Holder(m), qt.Recipe(rules={"*.in_proj_weight": INT8}))
    assert type(q.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear  # called, kept in float
    p = bridge.plan(Holder(m), qt.Recipe(type_rules={"MultiheadAttention": INT8}))
    assert p["attn.in_proj_weight"].spec is not None and p["attn.out_proj.weight"].spec is not None
    assert p["attn.bias_k"].spec is None and "no projection weight" in p["attn.bias_k"].rule
    assert p["attn.in_proj_weight"].module_type == "MultiheadAttention"
    p = bridge.plan(Holder(m), qt.Recipe(type_rules={"MultiheadAttention": INT8, "NonDynamicallyQuantizableLinear": None}))
    assert p["attn.in_proj_weight"].spec is not None and p["attn.out_proj.weight"].spec is None
    p = bridge.plan(Holder(m), qt.Recipe(type_rules={"Linear": INT8, "MultiheadAttention": None}))
    assert p["attn.in_proj_weight"].spec is None and p["attn.out_proj.weight"].spec is None
    with pytest.raises(ValueError, match=r"attn\.bias_k.*not the weight of a quantizable"):
        bridge.plan(Holder(m), qt.Recipe(rules={"*.bias_k": INT8}))


def test_refusals_name_the_module():
    m = mha()
    out = qt.QuantSpec(format="int8", dynamic=True)
    with pytest.raises(ValueError, match=r"^attn: the recipe quantizes the output of a MultiheadAttention"):
        bridge.quantize(Holder(m), qt.Recipe(type_rules={"MultiheadAttention": INT8}, output=out))
    static_channel = qt.QuantSpec(format="int8", granularity=qt.PerChannel(-1))
    with pytest.raises(ValueError, match=r"^attn: the recipe's static input spec of a MultiheadAttention"):
        bridge.quantize(Holder(m), qt.Recipe(type_rules={"MultiheadAttention": INT8}, input=static_channel),
                        calibration=[torch.randn(3, 2, 8)])
    with pytest.raises(ValueError, match=r"in_proj_weight: the root module itself cannot be replaced"):
        bridge.quantize(m, INT8)


def test_dtype_cast_keeps_codes():
    q = bridge.quantize(Holder(mha()), INT8, kernel="dequant").to(torch.float64)
    assert q.attn.in_proj_weight.dtype == torch.int8 and q.attn.in_proj_bias.dtype == torch.float64
    out = q(torch.randn(3, 2, 8, dtype=torch.float64))[0]
    assert out.dtype == torch.float64


def test_encoder_with_float_attention_and_quantized_feed_forward():
    """The issue's crash: the layer's fused path read ``linear1.weight`` (integer codes) under ``no_grad``."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1).eval()
    q = bridge.quantize(enc, qt.Recipe(type_rules={"Linear": INT8, "MultiheadAttention": None}), kernel="dequant")
    assert type(q.layers[0].self_attn) is nn.MultiheadAttention and isinstance(q.layers[0].linear1, QLinear)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        got = q(x)
    torch.testing.assert_close(got, torch_slow(dequantized_twin(enc, q), x), atol=1e-5, rtol=1e-5)
    assert enc.layers[0].activation_relu_or_gelu == 1  # the float model keeps its fused path
