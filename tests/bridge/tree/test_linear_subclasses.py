"""Subclasses of the replaceable torch classes (issue 51): DeepSeek-V4's grouped ``nn.Linear`` (``o_a_proj``, its own
forward) is never quantized as a plain Linear nor left in float silently: the plan keeps it with a reason that the
report prints; a rule naming the subclass's type is taken as any type rule."""

import torch

import bridge
import qtransform as qt
from bridge.app.record import kept_notes
from moe.tiny_moe import build_tiny_moe

SPEC = qt.get_preset("int4-g32").recipe.type_rules[0][1]


class Own(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_a_linear_subclass_is_kept_with_its_reason():
    model = torch.nn.Sequential(Own(64, 64), torch.nn.Linear(64, 32))
    plan = bridge.plan(model, qt.Recipe(type_rules={"Linear": SPEC}))
    assert plan["0.weight"].spec is None
    assert plan["0.weight"].rule.startswith("skipped (Own, a subclass of Linear, overrides its forward")
    assert plan["1.weight"].spec == SPEC
    q = bridge.quantize(model, qt.Recipe(type_rules={"Linear": SPEC}))
    x = torch.randn(3, 64)
    with torch.no_grad():  # the subclass still computes its own forward, in float
        assert torch.equal(q[0](x), model[0](x))


def test_deepseek_v4_grouped_output_projection_is_named_in_the_report():
    model = build_tiny_moe("deepseek_v4")
    plan = bridge.plan(model, qt.get_preset("int4-g32").recipe)
    grouped = [p for p in plan if p.endswith("o_a_proj.weight")]
    assert grouped and all(plan[p].spec is None and "DeepseekV4GroupedLinear" in plan[p].rule for p in grouped)
    assert any("DeepseekV4GroupedLinear, a subclass of Linear, overrides its forward" in n for n in kept_notes(plan))
    qmodel = bridge.quantize(model, qt.get_preset("int4-g32").recipe)
    ids = torch.randint(0, 200, (1, 8))
    with torch.no_grad():
        assert torch.isfinite(qmodel(ids).logits).all()


def test_a_subclass_that_computes_linear_is_quantized_as_linear():
    """Falcon's FalconLinear writes out nn.Linear's forward: a Linear rule reaches it and the quantized Linear that
    replaces it computes the dequantized weight's x @ W.T + b."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    torch.manual_seed(0)
    layer = FalconLinear(64, 32, bias=True)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():  # the fact the table states, checked independently of it
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    model = torch.nn.Sequential(layer).eval()
    plan = bridge.plan(model, qt.Recipe(type_rules={"Linear": SPEC}))
    assert plan["0.weight"].spec == SPEC and plan["0.weight"].rule == "type_rules[Linear]"
    q = bridge.quantize(model, qt.Recipe(type_rules={"Linear": SPEC}), kernel="dequant")
    w = qt.dequantize(bridge.extract(q)["0.weight"])
    with torch.no_grad():
        torch.testing.assert_close(q(x), torch.nn.functional.linear(x, w, layer.bias))
