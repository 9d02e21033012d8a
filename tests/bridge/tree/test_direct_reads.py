"""Linear layers whose weight a module above them reads directly stay in float, by a plan rule that says why
(issue 51, part 6: the walk over every model type found Mamba's ``dt_proj`` and RWKV's rescaled projections
quantized, their readers given the integer codes)."""

import pytest
import torch
from torch import nn

import bridge
import qtransform as qt
from bridge.tree import direct_reads

RECIPE = qt.get_preset("int4-g32").recipe
SPEC = RECIPE.type_rules[0][1]


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(32, 32)
        self.dt_proj = nn.Linear(32, 32)

    def forward(self, x):
        return (self.dt_proj.weight @ self.in_proj(x).T).T + self.dt_proj.bias


class Rescaled(nn.Module):
    """Reads a grandchild's weight (RWKV's ``block.attention.output.weight``), and a weight's dtype (the pipeline's
    own rule, not this one)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"attention": nn.ModuleDict({"output": nn.Linear(32, 32)})})])
        self.head = nn.Linear(32, 32)

    def rescale(self):
        for block in self.blocks:
            block.attention.output.weight.mul_(2)

    def forward(self, x):
        return self.head(self.blocks[0]["attention"]["output"](x.to(self.head.weight.dtype)))


def test_the_weights_read_directly_are_found():
    assert direct_reads(nn.Sequential(Mixer())) == {"0.dt_proj.weight": "Mixer.forward reads dt_proj.weight directly"}
    assert direct_reads(Rescaled()) == {
        "blocks.0.attention.output.weight": "Rescaled.rescale reads attention.output.weight directly"}


def test_they_stay_in_float_with_their_reason_and_the_model_computes_as_before():
    torch.manual_seed(0)
    model = nn.Sequential(Mixer()).eval()
    plan = bridge.plan(model, RECIPE)
    assert plan["0.dt_proj.weight"].spec is None and "reads dt_proj.weight directly" in plan["0.dt_proj.weight"].rule
    assert plan["0.in_proj.weight"].spec is not None
    qmodel = bridge.quantize(model, RECIPE, kernel="dequant")
    x = torch.randn(3, 32)
    ref = nn.Sequential(Mixer())
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref[0].in_proj.weight.copy_(qt.dequantize(bridge.extract(qmodel)["0.in_proj.weight"]))
        torch.testing.assert_close(qmodel(x), ref(x))


def test_a_glob_rule_that_selects_one_is_refused_by_name():
    with pytest.raises(ValueError, match=r"0\.dt_proj\.weight: recipe rules\[\*dt_proj\*\].*Mixer\.forward reads"):
        bridge.plan(nn.Sequential(Mixer()), qt.Recipe(rules={"*dt_proj*": SPEC}))


@pytest.mark.parametrize("model_type", ["mamba", "rwkv"])
def test_mamba_and_rwkv_give_transformers_own_logits(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {"mamba": dict(hidden_size=64, num_hidden_layers=2, vocab_size=256, state_size=8),
          "rwkv": dict(hidden_size=64, attention_hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       vocab_size=256, rescale_every=1)}[model_type]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    qmodel = bridge.quantize(model, RECIPE, kernel="dequant")
    kept = [p for p, m in bridge.plan(model, RECIPE).items() if "directly" in m.rule]
    assert kept
    ref = model.__class__(model.config).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for path, v in bridge.extract(qmodel).items():
            if isinstance(v, qt.QTensor):
                ref.get_parameter(path).copy_(qt.dequantize(v))
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(qmodel(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
