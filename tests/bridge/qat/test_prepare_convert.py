"""bridge.qat without training: prepare puts fake quantizers whose forward is the quantized model's, and
convert of an untrained prepared model is exactly what bridge.quantize makes (the same state tensors, the
same checkpoint bytes), for every kind of module, recipes with steps (their result is where training
starts) and activation quantizers (dynamic, static calibrated, after online rotations)."""

import copy
import pathlib

import pytest
import torch

import qtransform as qt
import bridge
from bridge import qat
from bridge_util import tiny_causal_lm
from qtransform import learn

SPECS = {
    "int4-g32-sym": qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)),
    "uint4-g64-asym": qt.QuantSpec(format="uint4", granularity=qt.PerGroup(64), symmetric=False),
    "uint2-g64-asym": qt.QuantSpec(format="uint2", granularity=qt.PerGroup(64), symmetric=False),
    "fp8-channel": qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0)),
    "nvfp4": qt.QuantSpec(format="nvfp4"),
    "mxfp4": qt.QuantSpec(format="mxfp4"),
}


def linear_recipe(spec, **kw):
    return qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"], **kw)


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> list:
    """The state entries that differ (name, dtype or bits); [] when the two are the same."""
    sa, sb = a.state_dict(), b.state_dict()
    if list(sa) != list(sb):
        return sorted(set(sa) ^ set(sb)) or ["(order)"]
    return [k for k in sa if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k])]


def files(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(pathlib.Path(directory).iterdir())}


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return tiny_causal_lm("llama").eval()


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return tiny_causal_lm("gpt2").eval()


@pytest.mark.parametrize("name", list(SPECS))
def test_untrained_convert_is_bridge_quantize(llama, name, tmp_path):
    recipe = linear_recipe(SPECS[name])
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = bridge.quantize(llama, recipe, kernel="dequant")
    fake = qat.prepare(llama, recipe)
    q = qat.convert(fake, kernel="dequant")
    assert same_state(q, ref) == []
    bridge.save(ref, tmp_path / "ref")
    bridge.save(q, tmp_path / "qat")
    assert files(tmp_path / "qat") == files(tmp_path / "ref")
    assert torch.equal(logits(fake, ids), logits(ref, ids))  # the fake model computes what the quantized one does
    assert torch.equal(logits(q, ids), logits(ref, ids))


@pytest.mark.parametrize("name", ["int4-g32-sym", "fp8-channel", "nvfp4"])
def test_gpt2_conv1d_transposed_spec(gpt2, name):
    """GPT-2's Conv1D stores its weight (in, out): the plan's stored spec (axes swapped) is what trains."""
    recipe = linear_recipe(SPECS[name])
    ref = bridge.quantize(gpt2, recipe, kernel="dequant")
    fake = qat.prepare(gpt2, recipe)
    attn = fake.transformer.h[0].attn.c_attn
    assert attn.parametrizations.weight[0].spec == qt.transposed_spec(SPECS[name], (192, 64))
    q = qat.convert(fake, kernel="dequant")
    assert same_state(q, ref) == []
    ids = torch.randint(0, 128, (2, 12))
    assert torch.equal(logits(fake, ids), logits(ref, ids))


def test_fake_weight_is_the_round_trip_and_grads_reach_weight_and_range(llama):
    spec = SPECS["uint4-g64-asym"]
    fake = qat.prepare(llama, linear_recipe(spec))
    up = fake.model.layers[1].mlp.up_proj
    w = up.parametrizations.weight.original
    expected = qt.dequantize(qt.quantize(w, qt.choose_qparams(w, spec)))  # computed apart from learn
    assert torch.equal(up.weight, expected)
    fake(torch.randint(0, 128, (1, 8)), labels=torch.randint(0, 128, (1, 8))).loss.backward()
    fq = up.parametrizations.weight[0]
    assert w.grad is not None and w.grad.abs().sum() > 0
    assert fq.lo.grad.abs().sum() > 0 and fq.hi.grad.abs().sum() > 0
    assert set(map(id, qat.quantizer_parameters(fake))) >= {id(fq.lo), id(fq.hi)}


def test_prepare_and_convert_leave_their_inputs_alone(llama):
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    fake = qat.prepare(llama, "int4-g32")
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in llama.modules())
    assert list(llama.state_dict()) == list(before)
    assert all(torch.equal(v, before[k]) for k, v in llama.state_dict().items())
    ids = torch.randint(0, 128, (1, 8))
    out = logits(fake, ids)
    q = qat.convert(fake, kernel="dequant")
    assert torch.equal(logits(fake, ids), out)  # the prepared model still works after a (copying) convert
    assert qat.prepared_plan(fake) is not None and qat.prepared_plan(q) is None
    assert torch.equal(logits(q, ids), out)
    same = qat.prepare(llama, "int4-g32", inplace=False)
    inplace = qat.prepare(copy.deepcopy(llama), "int4-g32", inplace=True)
    assert same_state(qat.convert(inplace, kernel="dequant"), qat.convert(same, kernel="dequant")) == []


def test_conv_and_embedding_modules(convnet, embednet):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    per_channel = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    per_feature = qt.QuantSpec(format="int8", granularity=qt.PerChannel(1))  # static: per channel of NCHW
    for net, args, recipe, calibration in [
            (convnet, (x,), qt.Recipe(default=per_channel, input=qt.QuantSpec(format="int8", dynamic=True)), None),
            (convnet, (x,), qt.Recipe(default=per_channel, input=per_feature), [(x,)]),
            (embednet, (torch.randint(0, 100, (2, 5)), torch.randint(0, 100, (6,)), torch.tensor([0, 3])),
             qt.QuantSpec(format="int4", granularity=qt.PerGroup(16)), None)]:
        ref = bridge.quantize(net, recipe, kernel="dequant", calibration=calibration)
        fake = qat.prepare(net, recipe, calibration=calibration)
        q = qat.convert(fake, kernel="dequant")
        assert [type(m).__name__ for m in q.children()] == [type(m).__name__ for m in ref.children()]
        assert same_state(q, ref) == []
        with torch.no_grad():
            assert torch.equal(fake(*args), ref(*args))
            assert torch.equal(q(*args), ref(*args))


@pytest.mark.parametrize("preset", ["w8a8-int8", "w8a8-int8-dynamic", "gptq4-g64", "hqq4-g64", "quarot-w4a4"])
def test_steps_and_activations_start_where_bridge_quantize_ends(llama, preset):
    """Static activation ranges start calibrated, steps (GPTQ, HQQ, QuaRot's rotations) run first: the untrained
    prepared model and its conversion are exactly bridge.quantize's model on the same calibration."""
    g = torch.Generator().manual_seed(2)
    calibration = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]
    recipe = qt.get_preset(preset).recipe
    ref = bridge.quantize(llama, recipe, kernel="dequant", calibration=calibration)
    fake = qat.prepare(llama, preset, calibration=calibration)
    q = qat.convert(fake, kernel="dequant")
    assert same_state(q, ref) == []
    ids = torch.randint(0, 128, (2, 12), generator=g)
    assert torch.equal(logits(fake, ids), logits(ref, ids))
    assert torch.equal(logits(q, ids), logits(ref, ids))
    sites = bridge.modules.actquant.activation_specs(q)
    assert sites == bridge.modules.actquant.activation_specs(ref)
    assert len(sites) == (14 if recipe.input is not None else 0)  # the input of every linear layer


def test_tied_weights_share_one_quantizer():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    net[1].weight = net[0].weight
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    fake = qat.prepare(net, spec)
    assert fake[0].parametrizations.weight[0] is fake[1].parametrizations.weight[0]
    assert fake[0].parametrizations.weight.original is fake[1].parametrizations.weight.original
    q = qat.convert(fake, kernel="dequant")
    ref = bridge.quantize(net, spec, kernel="dequant")
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(q(ids), ref(ids)) and torch.equal(fake(ids), ref(ids))
