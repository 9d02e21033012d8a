"""amd-quark itself, in one fresh interpreter that never imports ``bridge`` or ``qtransform`` (its import is
most of that process's time): transformers with Quark loads our Quark HF-format exports and gives the same
logits as our quantized models, for every architecture transformers' Quark loader handles (and the default
model's int4 and fp8 exports, marked long); Quark quantizes and exports tiny models itself, and we read those
exports bit for bit against its own dequantization."""

import json
from typing import NamedTuple

import pytest
import torch
from interop.quark.helpers import IDS, logits, quantize_save, quark_logits

import bridge
import qtransform as qt
from bridge import interop
from bridge.interop.quark import QuarkImporter
from bridge.modules import actquant


# name: (architecture, preset or spec, needs calibration, transformers class)
CASES = {
    "llama-int4-g32": ("llama", "int4-g32", False, "AutoModelForCausalLM"),
    "mistral-uint4-g32-asym": ("mistral", "int4-g32-asym", False, "AutoModelForCausalLM"),
    "qwen2-w8a8-int8": ("qwen2", "w8a8-int8", True, "AutoModelForCausalLM"),
    "phi3-int4-g32": ("phi3", "int4-g32", False, "AutoModelForCausalLM"),
    "opt-fp8-w8a8-kv": ("opt", "fp8-w8a8-kv", True, "AutoModelForCausalLM"),
    "bert-int8-channel": ("bert", qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))},
                                            exclude=["cls.*"]),  # the decoder is tied to the word embeddings
                          False, "AutoModelForMaskedLM"),
    "llama-hqq4-g64": ("llama", "hqq4-g64", False, "AutoModelForCausalLM"),
    "mistral-uint4-channel": ("mistral", qt.QuantSpec(format="uint4", granularity=qt.PerChannel(0), symmetric=False),
                              False, "AutoModelForCausalLM"),
    "llama-mxfp4": ("llama", "mxfp4", False, "AutoModelForCausalLM"),
    "qwen2-mxfp6": ("qwen2", "mxfp6", False, "AutoModelForCausalLM"),
    "llama-fp8-w8a8-kv": ("llama", "fp8-w8a8-kv", True, "AutoModelForCausalLM"),
}


def dequant_kernel(qmodel):
    """``qmodel`` computing with its dequantized weights in float32 (F.linear), as Quark's layers do."""
    for m in qmodel.modules():
        if isinstance(m, bridge.QModule):
            m.kernel = "dequant"
    return qmodel


class Case(NamedTuple):
    quark: torch.Tensor  # transformers + Quark's logits
    ours: torch.Tensor  # our quantized model's, its default kernels
    ours_dequant: torch.Tensor  # our quantized model's, the "dequant" kernel
    float: torch.Tensor  # the float model's
    quark_layers: int
    qmodel: torch.nn.Module


@pytest.fixture(scope="module")
def quark_process(tmp_path_factory):
    """Every case quantized, saved and exported by us, then one clean process: transformers + Quark load each
    of them (``{name: {"logits", "quark_layers"} | {"error"}}``), and Quark exports a tiny Llama per
    :data:`SCHEMES` (under the returned directory)."""
    tmp = tmp_path_factory.mktemp("quark")
    ours, todo = {}, {}
    for name, (arch, recipe, calib, auto) in CASES.items():
        model, qmodel = quantize_save(arch, recipe, tmp / name, calib=calib)
        interop.export(tmp / name, to="quark", out=tmp / f"{name}-quark")
        ours[name] = (logits(qmodel), logits(dequant_kernel(qmodel)), logits(model), qmodel)
        todo[name] = (tmp / f"{name}-quark", auto, IDS)
    own = tmp_path_factory.mktemp("quark-own")
    got = quark_logits(todo, tmp, then=(_QUARK_EXPORT, [str(own), *SCHEMES]))
    return ours, got, own


@pytest.fixture(scope="module")
def loaded(quark_process):
    """``{name: Case | the error transformers + Quark met}``."""
    ours, got, _ = quark_process
    return {name: got[name]["error"] if "error" in got[name] else
            Case(got[name]["logits"], *ours[name][:3], got[name]["quark_layers"], ours[name][3]) for name in CASES}


@pytest.fixture(scope="module")
def quark_exports(quark_process):
    """Quark's own exports (one directory per scheme), each with the weights and scales Quark dequantized after
    reloading it with transformers."""
    return quark_process[2]


def _check(case, *, expected=None, atol=1e-5, ties=0):
    """Quark's logits are ours (the dequant kernel) to float32 rounding, and ours with our default kernels to
    their own rounding; the quantization moved the logits far more than that (a float export would fail).

    ``ties``: tokens allowed to differ more, by one activation code flipped at a rounding tie (Quark rounds
    ``x * (1 / scale)`` where we round ``x / scale``: about one int8 activation in a million differs)."""
    assert isinstance(case, Case), case  # else the error transformers + Quark met
    assert case.quark_layers > 0  # the layers really are Quark's
    want = case.ours_dequant if expected is None else expected
    scale = want.abs().max().item()
    diff = (case.quark - want).abs().amax(-1).flatten()  # per token
    assert (diff > atol * scale).sum() <= ties and diff.max() <= (2e-2 if ties else atol) * scale, diff
    if expected is None:
        kernels = (case.ours - case.ours_dequant).abs().max().item()
        assert (case.quark - case.ours).abs().max().item() <= 2 * kernels + diff.max().item() + atol * scale
    moved = (case.float - want).abs().max()
    assert moved > 10 * atol * scale and (ties or moved > 10 * diff.max())


@pytest.mark.parametrize("name", [n for n in CASES if n != "llama-fp8-w8a8-kv"])
def test_transformers_with_quark_gives_our_logits(name, loaded):
    _check(loaded[name], ties=1 if name == "qwen2-w8a8-int8" else 0)


def test_fp8_kv_cache_of_a_rotary_model(loaded):
    """transformers' Quark layers quantize the key projection's output, before the rotary embedding;
    we (and vLLM) quantize the cached keys after it. Against a reference that quantizes before it
    (our model with the key quantizer moved onto k_proj's output) the logits agree to float32 rounding;
    against ours they differ by where the keys are rounded to fp8."""
    case = loaded["llama-fp8-w8a8-kv"]
    qmodel, hooks = case.qmodel, []  # already on the dequant kernel
    for m in qmodel.modules():
        if getattr(m, "key_spec", None) is not None:
            qp = qt.QParams(spec=m.key_spec, scale=m.k_scale.reshape(1, 1, 1))
            actquant.attach(m, "key", None)
            hooks.append(m.k_proj.register_forward_hook(lambda mod, i, out, qp=qp: qt.fake_quantize(out, qp)))
    assert len(hooks) == 2
    pre_rope = logits(qmodel)
    for h in hooks:
        h.remove()
    _check(case, expected=pre_rope)
    # the two places of the key quantization really differ (Quark's export holds the very k_scale either way)
    assert (case.quark - case.ours_dequant).abs().max() > 1e-3 * case.ours_dequant.abs().max()


# ---------------------------------------------------------------------------------------------- the default model
@pytest.mark.long  # about 5 minutes on 2 busy cores: two 135M checkpoints written, exported and loaded twice
def test_smollm2_int4_and_fp8_exports_load_in_transformers_without_bridge(tmp_path):
    from bridge.app import models

    model = models.load_causal_lm()
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    todo, ours = {}, {}
    for recipe in ("int4-g64", "fp8"):
        qmodel = bridge.quantize(model, qt.get_preset(recipe).recipe)
        bridge.save(qmodel, tmp_path / recipe)
        ours[recipe] = (logits(qmodel, ids), logits(dequant_kernel(qmodel), ids))
        del qmodel
        interop.export(tmp_path / recipe, to="quark", out=tmp_path / f"{recipe}-quark")
        todo[recipe] = (tmp_path / f"{recipe}-quark", "AutoModelForCausalLM", ids)
    float_logits = logits(model, ids)
    got = quark_logits(todo, tmp_path)
    for recipe in todo:
        assert "error" not in got[recipe], got[recipe]["error"]
        case = Case(got[recipe]["logits"], *ours[recipe], float_logits, got[recipe]["quark_layers"], None)
        assert case.quark_layers == 30 * 7  # every linear layer but the (tied) lm_head
        _check(case, atol=1e-4)
        assert (case.quark.argmax(-1) == case.ours_dequant.argmax(-1)).float().mean() > 0.95
        # against our default kernels (their own rounding): a top token differs only at a near tie, where our two
        # top logits are closer than the kernels' difference plus the tolerance above, on either side
        flip = (case.quark.argmax(-1) != case.ours.argmax(-1)).flatten()
        top = case.ours.topk(2, -1).values.flatten(0, -2)
        slack = (case.ours - case.ours_dequant).abs().amax(-1).flatten() + 1e-4 * case.ours_dequant.abs().max()
        assert ((top[:, 0] - top[:, 1])[flip] <= 2 * slack[flip]).all()


# ---------------------------------------------------------------------------------------------- Quark's own exports
_QUARK_EXPORT = r"""
import sys, torch, transformers as tf
from quark.torch import ModelQuantizer, export_safetensors
from quark.torch.quantization.config import config as C
fp8 = C.FP8E4M3PerTensorSpec(is_dynamic=False).to_quantization_spec()
for scheme in sys.argv[4:]:
    out = f"{sys.argv[3]}/{scheme}"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    kv = {}
    if scheme.startswith("uint4-g32-asym"):
        layer = C.QLayerConfig(weight=C.Uint4PerGroupSpec(ch_axis=-1, group_size=32, symmetric=False).to_quantization_spec())
    elif scheme == "int8-channel-a8":
        layer = C.QLayerConfig(weight=C.Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec(),
                               input_tensors=C.Int8PerTensorSpec(symmetric=False, is_dynamic=False).to_quantization_spec())
    elif scheme == "fp8-kv":
        layer = C.QLayerConfig(weight=fp8, input_tensors=fp8)
        kv = {n: C.QLayerConfig(weight=fp8, input_tensors=fp8, output_tensors=fp8) for n in ("*k_proj", "*v_proj")}
    elif scheme == "mxfp4":
        layer = C.QLayerConfig(weight=C.OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec())
    config = C.QConfig(global_quant_config=layer, layer_quant_config=dict(kv), kv_cache_quant_config=dict(kv),
                       kv_cache_group=list(kv), exclude=["lm_head"])
    quantizer = ModelQuantizer(config)
    model = quantizer.freeze(quantizer.quantize_model(model, [torch.randint(0, 128, (1, 16)) for _ in range(2)]))
    export_safetensors(model, out, pack_method="order" if scheme.endswith("-order") else "reorder")
    loaded = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    weights = {f"{n}.weight": m.weight_quantizer(m.weight).float() for n, m in loaded.named_modules()
               if type(m).__name__ == "QParamsLinear" and m.weight_quantizer is not None}
    scales = {n: t for n, t in loaded.state_dict().items() if n.endswith(("input_quantizer.scale", "output_quantizer.scale"))}
    torch.save({"weights": weights, "scales": scales}, f"{out}/dequantized.pt")
assert not [m for m in sys.modules if m.split(".")[0] in ("bridge", "qtransform")]
"""
SCHEMES = ["uint4-g32-asym", "uint4-g32-asym-order", "int8-channel-a8", "fp8-kv", "mxfp4"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_import_of_quarks_own_export(scheme, quark_exports):
    """We read Quark's export without re-quantizing and dequantize to the very values Quark does."""
    out = quark_exports / scheme
    truth = torch.load(out / "dequantized.pt")
    export = json.loads((out / "config.json").read_text())["quantization_config"]["export"]
    assert export["pack_method"] == ("order" if scheme.endswith("-order") else "reorder")
    source = QuarkImporter().read(out)
    assert sorted(source.meta.entries) == sorted(truth["weights"]) and len(truth["weights"]) == 14
    for path, w in truth["weights"].items():
        assert torch.equal(qt.dequantize(source.tree[path], dtype=torch.float32), w), path
    for name, s in truth["scales"].items():  # "<layer>.input_quantizer.scale": ours by its site's name
        layer, _, role = name.removesuffix("_quantizer.scale").rpartition(".")
        parent, _, proj = layer.rpartition(".")
        ours = (f"{parent}.{proj[0]}_scale" if role == "output" and proj in ("k_proj", "v_proj")
                else f"{layer}.{role}_scale")
        assert ours in source.tree and source.tree[ours].float().reshape(()) == s.float().reshape(()), name
    assert len(truth["scales"]) == {"int8-channel-a8": 14, "fp8-kv": 18}.get(scheme, 0)
    roles = {site.role for site in source.meta.activations}
    assert roles == {"int8-channel-a8": {"input"}, "fp8-kv": {"input", "key", "value"}}.get(scheme, set())
