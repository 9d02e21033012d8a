"""Quark HF-format exports loaded by transformers with amd-quark, in a fresh interpreter that never imports
``bridge`` or ``qtransform``: the same logits as our quantized models, for every architecture transformers'
Quark loader handles (and the default model's int4 and fp8 exports, marked long)."""

from typing import NamedTuple

import pytest
import torch
from interop.quark.helpers import IDS, logits, quantize_save, quark_logits

import bridge
import qtransform as qt
from bridge import interop
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
def loaded(tmp_path_factory):
    """Every case quantized, saved, exported and loaded by transformers + Quark in one clean process."""
    tmp = tmp_path_factory.mktemp("quark")
    ours, todo = {}, {}
    for name, (arch, recipe, calib, auto) in CASES.items():
        model, qmodel = quantize_save(arch, recipe, tmp / name, calib=calib)
        interop.export(tmp / name, to="quark", out=tmp / f"{name}-quark")
        ours[name] = (logits(qmodel), logits(dequant_kernel(qmodel)), logits(model), qmodel)
        todo[name] = (tmp / f"{name}-quark", auto, IDS)
    got = quark_logits(todo, tmp)
    return {name: got[name]["error"] if "error" in got[name] else
            Case(got[name]["logits"], *ours[name][:3], got[name]["quark_layers"], ours[name][3]) for name in CASES}


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
        assert (case.quark.argmax(-1) == case.ours.argmax(-1)).float().mean() > 0.95
