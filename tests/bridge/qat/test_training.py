"""bridge.qat in training loops: a plain torch loop (Adam, next-token loss + distillation from the float teacher)
lowers the loss and moves the ranges; the converted model computes exactly what the trained fake model does and
stores exactly the codes and parameters its fake quantizers used; it saves and loads back (bridge.load,
transformers' from_pretrained) and exports (compressed-tensors, Quark: imported back, the same logits);
transformers' Trainer, peft LoRA and torch.compile train a prepared model."""

import pytest
import torch

import qtransform as qt
import bridge
from bridge import qat
from bridge.interop import export
from bridge_util import tiny_causal_lm
from qtransform import learn

W_INT4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
STATIC_W8A8 = "w8a8-int8"  # int8 weights per channel, int8 inputs with static (learned) per-tensor ranges


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def dequant(model):
    """Every quantized module on the dequantizing reference forward (what the fake model computes)."""
    for m in model.modules():
        if isinstance(m, bridge.QModule) and "dequant" in m.available_kernels():
            m.kernel = "dequant"
    return model


@pytest.fixture(scope="module")
def teacher():
    torch.manual_seed(0)
    return tiny_causal_lm("llama").eval()


@pytest.fixture(scope="module")
def batch():
    return torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(3))


def train(fake, teacher, ids, steps=20):
    """Plain torch: Adam over every parameter, next-token loss + KL to the float teacher; the losses."""
    with torch.no_grad():
        target = teacher(ids).logits
    opt = torch.optim.Adam(fake.parameters(), lr=1e-3)
    fake.train()
    losses = []
    for _ in range(steps):
        out = fake(ids, labels=ids)
        loss = out.loss + qat.distill_loss(out.logits, target, temperature=2.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return fake.eval(), losses


@pytest.fixture(scope="module")
def trained(teacher, batch):
    """``{recipe name: (trained fake model, its converted model, losses)}``."""
    out = {}
    for name, recipe in [("int4", qt.Recipe(type_rules={"Linear": W_INT4}, exclude=["lm_head*"])),
                         (STATIC_W8A8, STATIC_W8A8)]:
        fake = qat.prepare(teacher, recipe, calibration=[batch[:2]])
        start = {n: p.detach().clone() for n, p in fake.named_parameters()}
        fake, losses = train(fake, teacher, batch)
        moved = {n for n, p in fake.named_parameters() if not torch.equal(p, start[n])}
        out[name] = fake, qat.convert(fake, kernel="dequant"), losses, moved
    return out


@pytest.mark.parametrize("name", ["int4", STATIC_W8A8])
def test_training_lowers_the_loss_and_convert_is_the_trained_fake_model(trained, batch, name):
    fake, q, losses, moved = trained[name]
    assert losses[-1] < 0.8 * losses[0]
    ranges = {n for n in moved if n.endswith((".lo", ".hi"))}
    assert any(".parametrizations.weight.0." in n for n in ranges)  # the weights' ranges trained
    if name == STATIC_W8A8:
        assert any(".qat_input." in n for n in ranges)  # and the static input ranges
    assert torch.equal(logits(q, batch), logits(fake, batch))


def test_converted_codes_and_scales_are_the_fake_quantizers(trained):
    fake, q, _, _ = trained["int4"]
    for name, m in q.named_modules():
        if not isinstance(m, bridge.QLinear):
            continue
        p = fake.get_submodule(name).parametrizations.weight
        stored = learn.to_qparams(p[0].learned())
        qw = m.qweight
        assert torch.equal(qw.qparams.scale, stored.scale), name
        # the trained float weight, quantized by those parameters, by the core's own quantize
        assert torch.equal(qw.codes, qt.quantize(p.original, stored).codes), name
        assert torch.equal(qt.dequantize(qw), fake.get_submodule(name).weight), name


def test_save_load_back_and_export(trained, teacher, batch, tmp_path):
    from transformers import AutoModelForCausalLM

    for name, (fake, q, _, _) in trained.items():
        bridge.save(q, tmp_path / name)
        ref = logits(fake, batch)
        back = dequant(bridge.load(tmp_path / name, like=teacher))
        assert torch.equal(logits(back, batch), ref), name
        hf = dequant(AutoModelForCausalLM.from_pretrained(tmp_path / name))
        assert torch.equal(logits(hf, batch), ref), name
        assert hf.config.quantization_config.recipe == qt.get_preset(STATIC_W8A8).recipe or name == "int4"
        for target in ("compressed-tensors", "quark"):  # the exporters take it as any bridge.quantize result
            export(tmp_path / name, to=target, out=tmp_path / f"{name}-{target}")
            imported = dequant(bridge.load(tmp_path / f"{name}-{target}", like=teacher))
            assert torch.equal(logits(imported, batch), ref), (name, target)


def test_distill_loss_on_model_outputs(teacher, batch):
    """The helper reads logits and hidden states off transformers' outputs; values by hand."""
    fake = qat.prepare(teacher, "int4-g32")
    with torch.no_grad():
        s, t = fake(batch, output_hidden_states=True), teacher(batch, output_hidden_states=True)
    mask = torch.ones(batch.shape)
    mask[:, :5] = 0
    log_s, log_t = torch.log_softmax(s.logits / 2, -1), torch.log_softmax(t.logits / 2, -1)
    kl = torch.nn.functional.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)
    expected = (kl * mask).sum() / mask.sum() * 4
    got = qat.distill_loss(s, t, temperature=2.0, mask=mask)
    assert torch.allclose(got, expected, rtol=1e-5)
    rel = [((a - b).square().mean(-1)[:, 5:].mean() / b.square().mean(-1)[:, 5:].mean())
           for a, b in zip(s.hidden_states, t.hidden_states)]
    both = qat.distill_loss(s, t, temperature=2.0, mask=mask, hidden_weight=0.5)
    assert torch.allclose(both, expected + 0.5 * torch.stack(rel).mean(), rtol=1e-5)
    with pytest.raises(TypeError, match="output_hidden_states"):
        qat.distill_loss(s.logits, t, hidden_weight=1.0)


class Rows(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_transformers_trainer_trains_a_prepared_model(teacher, batch, tmp_path):
    from transformers import Trainer, TrainingArguments

    fake = qat.prepare(teacher, "int4-g32")
    up = fake.model.layers[0].mlp.up_proj.parametrizations.weight
    before = up.original.detach().clone(), up[0].hi.detach().clone()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
                             report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=fake, args=args, train_dataset=Rows(batch))
    result = trainer.train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(up.original, before[0]) and not torch.equal(up[0].hi, before[1])
    q = qat.convert(fake.eval(), kernel="dequant")
    assert torch.equal(logits(q, batch), logits(fake, batch))


def test_peft_lora_trains_on_a_prepared_model(teacher, batch):
    peft = pytest.importorskip("peft")
    fake = qat.prepare(teacher, "int4-g32")
    model = peft.get_peft_model(fake, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # the fake-quantized base is frozen
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert qat.WeightFakeQuant in map(type, q_proj.base_layer.parametrizations.weight)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.long
def test_compile_forward_and_backward(teacher, batch):
    fake = qat.prepare(teacher, "int4-g32")
    compiled = torch.compile(fake, backend="aot_eager")  # dynamo + AOT autograd, no C++ build
    out = compiled(batch, labels=batch)
    out.loss.backward()
    fq = fake.model.layers[1].mlp.down_proj.parametrizations.weight
    assert fq.original.grad.abs().sum() > 0 and fq[0].hi.grad.abs().sum() > 0
    assert torch.equal(out.logits.detach(), logits(fake, batch))


@pytest.mark.long
def test_compile_inductor(teacher, batch):
    fake = qat.prepare(teacher, STATIC_W8A8, calibration=[batch[:2]])
    out = torch.compile(fake)(batch, labels=batch)
    out.loss.backward()
    assert torch.allclose(out.logits.detach(), logits(fake, batch), atol=1e-4)
