"""QLoRA with peft on qtransform's quantized modules (bridge.hf.peft): a tiny Llama saved with
bridge.save, loaded with from_pretrained, LoRA attached with get_peft_model, trained, saved, reloaded,
merged. Expected values are computed by hand from the dequantized weight and the adapter matrices."""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import qtransform as qt
import bridge
from bridge_util import same_bits, tiny_causal_lm

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from bridge.hf.peft import QLoraLinear  # noqa: E402

# int4 groups of 32 along in_features, out_features multiples of 16: every projection of the tiny Llama
# (hidden 64, intermediate 128, k/v 32) is eligible for the packed int4 CPU kernel
SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), symmetric=False)
RECIPE = qt.Recipe(default=SPEC, exclude=["lm_head*", "*embed*"])
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qlora") / "ck"
    bridge.save(bridge.quantize(tiny_causal_lm("llama").eval(), RECIPE), path)
    return path


def load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path)


def lora_config(**kw):
    return LoraConfig(**{"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": TARGETS, **kw})


def quantized_buffers(model):
    """``{path: copy}`` of the quantized modules' buffers, by the path in the unwrapped model."""
    return {f"{n}.{b}".removeprefix("base_model.model.").replace(".base_layer.", "."): t.clone()
            for n, m in model.named_modules() if isinstance(m, bridge.QModule)
            for b, t in m.named_buffers(recurse=False)}


def lora_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QLoraLinear)}


def randomize_b(model, seed=1):
    """peft initialises lora_B to zero (the adapter starts as a no-op): give it values to check against."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_layers(model).values():
            w = m.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.05)


def by_hand(x, base, a, b, scaling):
    """x @ A.T @ B.T * scaling + the float op on the dequantized weight (stored (in, out) for Conv1D)."""
    w = qt.dequantize(base.qweight, dtype=torch.float32)
    y = x @ w if base.transposed else F.linear(x, w)
    if base.bias is not None:
        y = y + base.bias
    return y + (x @ a.T @ b.T) * scaling


def group_step(w, group=32):
    """Half-step bound of asymmetric 4-bit round-to-nearest per group along the last axis, by hand."""
    g = w.reshape(w.shape[0], -1, group)
    step = (g.amax(-1) - g.amin(-1)) / 15
    return (step / 2).repeat_interleave(group, dim=1)


def test_get_peft_model_wraps_qlinear_without_registration(checkpoint):
    # on the main branch before bridge.hf.peft, peft raised "Target module QLinear(...) is not supported"
    model = load(checkpoint)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Unsupported layer type.*")
        lm = get_peft_model(model, lora_config())
    layers = lora_layers(lm)
    assert len(layers) == 2 * len(TARGETS)
    for name, m in layers.items():
        assert isinstance(m.base_layer, bridge.QLinear), name
        assert m.base_layer.kernel == "int4pack_cpu", name  # the packed kernel, not the reference path
        assert m.lora_A["default"].weight.shape == (8, m.base_layer.in_features)
        assert m.lora_B["default"].weight.shape == (m.base_layer.out_features, 8)
    trainable = {n for n, p in lm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert lm.base_model.model.model.layers[0].self_attn.q_proj.weight.device.type == "cpu"  # qweight.device


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_forward_equals_lora_by_hand(kind):
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    float_layer = torch.nn.Linear(64, 32) if kind == "linear" else Conv1D(32, 64)
    model = bridge.quantize(torch.nn.Sequential(float_layer), SPEC)
    lm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["0"]))
    randomize_b(lm)
    layer = lm.base_model.model[0]
    assert isinstance(layer, QLoraLinear) and layer.base_layer.transposed == (kind == "conv1d")
    x = torch.randn(3, 5, 64)
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    want = by_hand(x, layer.base_layer, a, b, 2.0)
    with torch.no_grad():
        layer.base_layer.kernel = "dequant"
        torch.testing.assert_close(lm(x), want, rtol=1e-5, atol=1e-5)
        layer.base_layer.kernel = "auto"  # the packed kernel computes in bfloat16 (a stored (in, out) has none)
        assert layer.base_layer.kernel == ("int4pack_cpu" if kind == "linear" else "dequant")
        torch.testing.assert_close(lm(x), want, rtol=2e-2, atol=2e-2)


def test_train_save_reload_merge(checkpoint, tmp_path):
    from transformers.trainer_utils import validate_quantization_for_training
    torch.manual_seed(0)
    model = load(checkpoint)
    with pytest.raises(ValueError, match="purely quantized"):
        validate_quantization_for_training(model)  # a quantized model trains through adapters only
    before = quantized_buffers(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    lm = get_peft_model(model, lora_config())
    validate_quantization_for_training(lm)  # transformers' Trainer accepts it (is_trainable)
    assert all(m.base_layer.kernel == "int4pack_cpu" for m in lora_layers(lm).values())
    ids = torch.randint(3, 128, (2, 16))
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    lm.train()
    for _ in range(6):
        opt.zero_grad()
        loss = lm(input_ids=ids, labels=ids).loss
        loss.backward()
        with_grad = {n for n, p in lm.named_parameters() if p.grad is not None}
        assert with_grad and all(".lora_A." in n or ".lora_B." in n for n in with_grad)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses  # 4.86 -> 4.17 at the time of writing
    assert len(with_grad) == 4 * len(TARGETS)  # every lora_A and lora_B of both layers
    after = quantized_buffers(lm)
    assert before.keys() == after.keys() and all(same_bits(before[k], after[k]) for k in before)
    base_params = {n.removeprefix("base_model.model."): p for n, p in lm.named_parameters() if "lora_" not in n}
    assert base_params.keys() == frozen.keys()  # the base model's float parameters (norms, embeddings, head)
    assert all(torch.equal(base_params[n], p) for n, p in frozen.items())
    lm.eval()
    with torch.no_grad():
        trained = lm(ids).logits

    lm.save_pretrained(tmp_path / "adapter")
    again = PeftModel.from_pretrained(load(checkpoint), tmp_path / "adapter")
    assert len(lora_layers(again)) == 2 * len(TARGETS)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, trained, rtol=0, atol=0)

    # merge: dequantize, add B @ A * scaling, re-quantize with the same spec (round-to-nearest)
    expect = {}
    for name, m in lora_layers(lm).items():
        a, b = m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach()
        expect[name.removeprefix("base_model.model.")] = (
            qt.dequantize(m.base_layer.qweight, dtype=torch.float32) + b @ a * 2.0, m.base_layer.spec)
    merged = lm.merge_and_unload()
    assert not lora_layers(merged) and not any("lora_" in n for n, _ in merged.named_parameters())
    for name, (w, spec) in expect.items():
        m = merged.get_submodule(name)
        assert isinstance(m, bridge.QLinear) and m.spec == spec and m.kernel == "int4pack_cpu"
        err = (qt.dequantize(m.qweight, dtype=torch.float32) - w).abs()
        assert bool((err <= group_step(w) * 1.001 + 1e-6).all()), name
    with torch.no_grad():
        got = merged(ids).logits
        plain = PeftModel.from_pretrained(load(checkpoint), tmp_path / "adapter")
        with plain.disable_adapter():
            untrained = plain(ids).logits
    # the merged model is the trained one to within the re-quantization error, far from the base model
    # (the mean difference was 6% of the adapter's effect at the time of writing)
    assert (got - trained).abs().mean() < 0.25 * (untrained - trained).abs().mean()
    merged.save_pretrained(tmp_path / "merged")  # the same checkpoint format: specs and shapes unchanged
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "merged")(ids).logits, got)


def test_merge_unmerge_never_write_the_packed_buffers():
    torch.manual_seed(0)
    model = bridge.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)), SPEC)
    lm = get_peft_model(model, LoraConfig(r=4, target_modules=["0"]))
    randomize_b(lm)
    layer = lm.base_model.model[0]
    base = layer.base_layer
    held = dict(base.named_buffers())
    snapshot = {k: v.clone() for k, v in held.items()}
    x = torch.randn(4, 64)
    with torch.no_grad():
        unmerged = lm(x)
        layer.merge(safe_merge=True)
        assert layer.merged and layer.merged_adapters == ["default"]
        assert all(same_bits(held[k], snapshot[k]) for k in held)  # the old tensors untouched
        assert not all(same_bits(b, snapshot[k]) for k, b in base.named_buffers())  # the weight changed
        torch.testing.assert_close(lm(x), unmerged, rtol=0.1, atol=0.1)
        layer.unmerge()
        assert not layer.merged
        assert all(same_bits(b, snapshot[k]) for k, b in base.named_buffers())  # restored bit for bit
        torch.testing.assert_close(lm(x), unmerged, rtol=0, atol=0)
        layer.lora_B["default"].weight[0, 0] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            layer.merge(safe_merge=True)
        assert not layer.merged and all(same_bits(b, snapshot[k]) for k, b in base.named_buffers())


@pytest.mark.parametrize("option", [dict(use_dora=True), dict(lora_bias=True), dict(init_lora_weights="pissa")])
def test_unsupported_lora_options_are_refused_by_name(option):
    model = bridge.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)), SPEC)
    name = next(iter(option))
    with pytest.raises(ValueError, match=name if name != "use_dora" else "plain LoRA only"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["0"], **option))


@pytest.mark.parametrize("spec, kernel", [
    (SPEC, "int4pack_cpu"),
    (qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)), "int8pack_cpu"),
])
def test_backward_through_the_default_kernel_matches_dequant(spec, kernel):
    torch.manual_seed(0)
    m = bridge.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)), spec)[0]
    assert m.kernel == kernel
    x = torch.randn(2, 3, 64)
    gy = torch.randn(2, 3, 32)
    grads = []
    for k in ("auto", "dequant"):
        m.kernel = k
        xg = x.clone().requires_grad_(True)
        m(xg).backward(gy)
        grads.append(xg.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=2e-2)  # bf16 rounding
    torch.testing.assert_close(grads[1], gy @ qt.dequantize(m.qweight))


def test_import_bridge_without_peft_never_imports_it():
    code = """
import importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'peft' else real(name, *a)
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'peft':
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
import bridge
assert 'peft' not in sys.modules and 'bridge.hf.peft' not in sys.modules, sorted(sys.modules)
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
