"""Patterns of transformers 5.25's mixture-of-experts models, on toy modules: an experts class whose ``forward``
wraps the standard one (Ergo: routes one per row, a norm per expert), a decoder layer that casts its input to a
grandchild's weight dtype (Ergo's ``self.self_attn.o_proj.weight.dtype``), and a router module beside the
experts whose linear layer also scores zero-computation experts (LongCat-Flash's ``router.classifier``)."""

import copy
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations import use_experts_implementation

import bridge
import qtransform as qt
from bridge.calibrate.experts import expert_sites, tapping

_E, _H, _I = 4, 32, 32


@use_experts_implementation(has_gate=False, is_transposed=True)
class Projections(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = _E
        self.up_proj = nn.Parameter(torch.randn(_E, _H, _I) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(_E, _I, _H) * 0.2)
        self.act_fn = nn.ReLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            y = self.act_fn(hidden_states[tok] @ self.up_proj[e]) @ self.down_proj[e]
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out


class WrappedExperts(Projections):
    """Each route on its own row through the standard forward, then a scale per expert, then the weighted sum."""

    def __init__(self, config):
        super().__init__(config)
        self.post_scale = nn.Parameter(torch.rand(_E, _H) + 0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        hidden_states = hidden_states.repeat_interleave(top_k_index.size(1), dim=0)
        flat = top_k_index.reshape(-1, 1)
        y = super().forward(hidden_states, flat, hidden_states.new_ones(flat.shape))
        y = (y * self.post_scale[flat.flatten()]).view(*top_k_index.shape, -1)
        return (y * top_k_weights.unsqueeze(-1)).sum(1)


class Router(nn.Module):
    """A router module holding its one linear layer, which also scores two zero-computation experts."""

    def __init__(self):
        super().__init__()
        self.n_routed_experts = _E + 2
        self.classifier = nn.Linear(_H, self.n_routed_experts, bias=False)

    def forward(self, x):
        return F.linear(x.float(), self.classifier.weight.float()).softmax(-1).topk(2, dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.o_proj = nn.Linear(_H, _H, bias=False)

    def forward(self, x):
        return self.o_proj(x)


class Layer(nn.Module):
    def __init__(self, experts_class):
        super().__init__()
        self.self_attn = Attention()
        self.router = Router()
        self.experts = experts_class(SimpleNamespace(_experts_implementation="eager"))

    def forward(self, x):
        x = x + self.self_attn(x.to(self.self_attn.o_proj.weight.dtype))
        x = x.reshape(-1, x.shape[-1])  # (tokens, hidden)
        weights, index = self.router(x)
        index = torch.where(index < _E, index, 0)  # the zero-computation experts: expert 0 with weight 0
        weights = torch.where(index < _E, weights, 0.0)
        return x + self.experts(x, index, weights)


def _model(experts_class=WrappedExperts):
    torch.manual_seed(0)
    return nn.Sequential(Layer(experts_class), Layer(experts_class)).eval()


def _reference(model, qmodel):
    """The float model with the quantized model's dequantized weights put back."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for path, v in bridge.extract(qmodel).items():
            if isinstance(v, qt.QTensor):
                ref.get_parameter(path).copy_(qt.dequantize(v))
    return ref


def test_the_wrapping_forward_runs_around_the_quantized_experts():
    model = _model()
    qmodel = bridge.quantize(model, qt.get_preset("int4-g32").recipe, kernel="dequant")
    assert isinstance(qmodel[0].experts, bridge.QExperts) and qmodel[0].experts.quantized_names
    x = torch.randn(10, _H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), _reference(model, qmodel)(x), rtol=1e-5, atol=1e-6)


def test_calibration_taps_keep_the_wrapping_forward():
    model = _model()
    sites = expert_sites(model, [qt.Site(f"{i}.experts.{w}", "input") for i in (0, 1) for w in ("up_proj", "down_proj")])
    x = torch.randn(10, _H, generator=torch.Generator().manual_seed(1))
    rows = {}
    with torch.no_grad():
        want = model(x)
        with tapping(model, sites, lambda site, e, t: rows.setdefault((site.module, e), []).append(t.shape[0])):
            got = model(x)
    torch.testing.assert_close(got, want)
    assert sum(sum(n) for (m, _), n in rows.items() if m == "0.experts.up_proj") == 10 * 2  # tokens x top-k


def test_a_standard_experts_class_runs_the_loop_alone():
    model = _model(Projections)
    qmodel = bridge.quantize(model, qt.get_preset("int4-g32").recipe, kernel="dequant")
    x = torch.randn(10, _H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), _reference(model, qmodel)(x), rtol=1e-5, atol=1e-6)


def test_a_weight_dtype_read_by_a_grandparent_keeps_it_in_float():
    p = bridge.plan(_model(), qt.get_preset("int4-g32").recipe)
    m = p["0.self_attn.o_proj.weight"]
    assert m.spec is None and "Layer.forward casts its input to this weight's dtype" in m.rule


def test_the_linear_of_a_router_module_is_the_router():
    model = _model()
    types = bridge.tree.module_types(model)
    assert types["0.router.classifier.weight"] == "Router"
    p = bridge.plan(model, qt.get_preset("int4-g32").recipe)
    assert p["0.router.classifier.weight"].spec is None
