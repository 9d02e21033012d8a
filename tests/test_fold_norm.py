"""qt.fold_norms: a BatchNorm in inference form folded into the conv / linear before it.

The expected outputs are those of torch's own modules, producer then BatchNorm, run in eval mode (the norm
with its running statistics); the folded tree is run through the producer alone (``functional_call``), the
norm gone. Float32 models agree to float32 rounding (rtol 1e-5)."""

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

import qtransform as qt


def _randomize_bn(bn: nn.Module, g: torch.Generator) -> nn.Module:
    """Running statistics and affine parameters far from their defaults (so a fold that ignores one shows)."""
    c = bn.num_features
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c, generator=g))
        bn.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.1)
        if bn.affine:
            bn.weight.copy_(torch.randn(c, generator=g))
            bn.bias.copy_(torch.randn(c, generator=g))
    bn.num_batches_tracked.fill_(7)
    return bn.eval()


def _pair(producer: nn.Module, bn_cls, seed=0, affine=True, eps=1e-5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in producer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    c = producer.out_features if isinstance(producer, nn.Linear) else producer.out_channels
    bn = _randomize_bn(bn_cls(c, affine=affine, eps=eps), g)
    return nn.Sequential(producer, bn).eval()


def _fold(model: nn.Sequential) -> dict:
    p = model[0]
    transposed = isinstance(p, nn.modules.conv._ConvTransposeNd)
    return qt.fold_norms(dict(model.state_dict()), [qt.NormFold("0", "1", eps=model[1].eps, transposed=transposed,
                                                                groups=getattr(p, "groups", 1))])


def _folded_module(model: nn.Sequential) -> nn.Module:
    """The producer alone with a bias slot (the skeleton the folded tree fills): a ``Sequential`` whose norm
    is an Identity."""
    m = copy.deepcopy(model)
    if m[0].bias is None:
        m[0].bias = nn.Parameter(torch.zeros(m[0].weight.shape[1] * m[0].groups if isinstance(
            m[0], nn.modules.conv._ConvTransposeNd) else m[0].weight.shape[0]))
    m[1] = nn.Identity()
    return m


CASES = {
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), nn.BatchNorm1d, (2, 4, 9)),
    "conv2d": (lambda: nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d, (2, 3, 7, 7)),
    "conv2d-no-bias": (lambda: nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d, (2, 3, 7, 7)),
    "conv2d-grouped": (lambda: nn.Conv2d(6, 9, 3, groups=3, bias=False), nn.BatchNorm2d, (2, 6, 6, 6)),
    "conv2d-depthwise": (lambda: nn.Conv2d(8, 8, 3, groups=8, padding=1), nn.BatchNorm2d, (2, 8, 5, 5)),
    "conv2d-depthwise-x2": (lambda: nn.Conv2d(4, 8, 3, groups=4), nn.BatchNorm2d, (2, 4, 5, 5)),
    "conv3d": (lambda: nn.Conv3d(2, 5, 2, bias=False), nn.BatchNorm3d, (2, 2, 4, 4, 4)),
    "convT1d": (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2), nn.BatchNorm1d, (2, 4, 5)),
    "convT2d": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, bias=False), nn.BatchNorm2d, (2, 4, 5, 5)),
    "convT2d-grouped": (lambda: nn.ConvTranspose2d(6, 4, 3, groups=2), nn.BatchNorm2d, (2, 6, 5, 5)),
    "convT2d-grouped-3": (lambda: nn.ConvTranspose2d(6, 9, 2, groups=3, bias=False), nn.BatchNorm2d, (2, 6, 4, 4)),
    "convT3d": (lambda: nn.ConvTranspose3d(3, 4, 2), nn.BatchNorm3d, (2, 3, 3, 3, 3)),
    "linear": (lambda: nn.Linear(10, 7), nn.BatchNorm1d, (5, 10)),
    "linear-no-bias": (lambda: nn.Linear(10, 7, bias=False), nn.BatchNorm1d, (5, 10)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_folded_equals_the_eval_mode_pair(name, affine):
    make, bn_cls, shape = CASES[name]
    model = _pair(make(), bn_cls, affine=affine)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    expected = model(x)  # torch's conv then BatchNorm in eval mode
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = _fold(model)
    got = functional_call(_folded_module(model), new, (x,))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert sorted(new) == ["0.bias", "0.weight"]
    assert new["0.weight"].shape == model[0].weight.shape and new["0.weight"].dtype == torch.float32
    for k, v in model.state_dict().items():  # inputs untouched
        assert torch.equal(v, before[k]), k


def test_hand_computed_linear_and_depthwise_values():
    # k = gamma / sqrt(var + eps) = [3 / 2, -1 / 1] with var = [3.5, 0.5], eps = 0.5
    params = {"c.weight": torch.tensor([[[[1.0, 2.0]]], [[[4.0, -2.0]]]]), "c.bias": torch.tensor([1.0, 0.0]),
              "n.weight": torch.tensor([3.0, -1.0]), "n.bias": torch.tensor([0.25, 2.0]),
              "n.running_mean": torch.tensor([3.0, -1.0]), "n.running_var": torch.tensor([3.5, 0.5]),
              "n.num_batches_tracked": torch.tensor(3), "other": torch.ones(2)}
    new = qt.fold_norms(params, [("c", "n", 0.5)])
    assert list(new) == ["c.weight", "c.bias", "other"]
    assert new["c.weight"].tolist() == [[[[1.5, 3.0]]], [[[-4.0, 2.0]]]]
    # (1 - 3) * 1.5 + 0.25 = -2.75; (0 + 1) * -1 + 2 = 1
    assert new["c.bias"].tolist() == [-2.75, 1.0]
    assert new["other"] is params["other"]


def test_transposed_grouped_layout_by_hand():
    # ConvTranspose with in=4, out=4, groups=2: weight (4, 2, 1); output channel g * 2 + j is column j of rows
    # 2g, 2g + 1. Scales k = [1, 2, 3, 4] (gamma, var 1, eps 0).
    w = torch.arange(8.0).reshape(4, 2, 1)
    params = {"t.weight": w, "n.weight": torch.tensor([1.0, 2.0, 3.0, 4.0]), "n.bias": torch.zeros(4),
              "n.running_mean": torch.zeros(4), "n.running_var": torch.ones(4)}
    new = qt.fold_norms(params, [qt.NormFold("t", "n", 0.0, transposed=True, groups=2)])
    expected = torch.tensor([[0.0, 2.0], [2.0, 6.0], [12.0, 20.0], [18.0, 28.0]]).reshape(4, 2, 1)
    assert torch.equal(new["t.weight"], expected)


def test_several_folds_and_order_kept():
    a = _pair(nn.Conv2d(3, 4, 1), nn.BatchNorm2d, seed=2)
    b = _pair(nn.Conv2d(4, 5, 1, bias=False), nn.BatchNorm2d, seed=3)
    model = nn.Sequential(a[0], a[1], nn.ReLU(), b[0], b[1]).eval()
    x = torch.randn(2, 3, 4, 4)
    new = qt.fold_norms(dict(model.state_dict()), [qt.NormFold("0", "1", 1e-5), qt.NormFold("3", "4", 1e-5)])
    assert list(new) == ["0.weight", "0.bias", "3.weight", "3.bias"]
    folded = nn.Sequential(copy.deepcopy(a[0]), nn.Identity(), nn.ReLU(), nn.Conv2d(4, 5, 1), nn.Identity())
    torch.testing.assert_close(functional_call(folded, new, (x,)), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_float64_arithmetic_cast_back_once(dtype):
    model = _pair(nn.Conv2d(3, 4, 3), nn.BatchNorm2d, seed=4).to(dtype)
    sd = dict(model.state_dict())
    new = _fold(model)
    assert new["0.weight"].dtype == dtype and new["0.bias"].dtype == dtype
    k = sd["1.weight"].double() / torch.sqrt(sd["1.running_var"].double() + model[1].eps)
    assert torch.equal(new["0.weight"], (sd["0.weight"].double() * k[:, None, None, None]).to(dtype))
    shift = (sd["0.bias"].double() - sd["1.running_mean"].double()) * k + sd["1.bias"].double()
    assert torch.equal(new["0.bias"], shift.to(dtype))


def test_grad_through_the_fold_matches_the_unfolded_model():
    model = _pair(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d, seed=5)
    x = torch.randn(2, 3, 5, 5)
    params = {k: v.detach() for k, v in model.state_dict().items() if v.is_floating_point()}
    counts = {k: v for k, v in model.state_dict().items() if not v.is_floating_point()}  # num_batches_tracked
    skeleton = _folded_module(model)

    def folded_loss(p):
        new = qt.fold_norms({**p, **counts}, [qt.NormFold("0", "1", model[1].eps)])
        return functional_call(skeleton, new, (x,)).square().sum()

    g = grad(folded_loss)(params)
    model.zero_grad()
    model(x).square().sum().backward()  # autograd through torch's eval-mode BatchNorm
    for name in ("0.weight", "1.weight", "1.bias"):
        expected = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(g[name], expected, rtol=1e-4, atol=1e-5)
    assert sorted(g) == sorted(params)


def test_refuses_a_norm_without_running_stats():
    params = {"c.weight": torch.ones(2, 3), "n.weight": torch.ones(2), "n.bias": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"n: the norm has no running statistics.*track_running_stats=False"):
        qt.fold_norms(params, [qt.NormFold("c", "n", 1e-5)])


def _linear_bn(c_out=3, c_norm=3):
    return {"fc.weight": torch.ones(c_out, 2), "bn.weight": torch.ones(c_norm), "bn.bias": torch.zeros(c_norm),
            "bn.running_mean": torch.zeros(c_norm), "bn.running_var": torch.ones(c_norm)}


@pytest.mark.parametrize("entry", ["running_mean", "running_var", "weight", "bias"])
def test_refuses_channel_mismatch_by_path(entry):
    params = _linear_bn()
    params[f"bn.{entry}"] = torch.ones(4)
    with pytest.raises(ValueError, match=rf"bn\.{entry}: shape \(4,\) does not match the 3 output channels of "
                                         r"fc\.weight"):
        qt.fold_norms(params, [qt.NormFold("fc", "bn", 1e-5)])


def test_refuses_transposed_channel_mismatch_and_bad_groups():
    params = _linear_bn(c_out=4, c_norm=3)
    params["t.weight"] = params.pop("fc.weight").reshape(4, 2, 1)  # transposed: 2 * groups out channels
    with pytest.raises(ValueError, match=r"bn\.running_mean: shape \(3,\) does not match the 4 output channels "
                                         r"of t\.weight .*groups=2"):
        qt.fold_norms(params, [qt.NormFold("t", "bn", 1e-5, transposed=True, groups=2)])
    with pytest.raises(ValueError, match=r"t\.weight: groups=3 does not divide axis 0"):
        qt.fold_norms(params, [qt.NormFold("t", "bn", 1e-5, transposed=True, groups=3)])


@pytest.mark.parametrize("entry,value", [("running_mean", float("nan")), ("running_var", float("inf")),
                                         ("weight", float("nan")), ("bias", float("-inf"))])
def test_refuses_non_finite_values_by_path(entry, value):
    params = _linear_bn()
    params[f"bn.{entry}"] = params[f"bn.{entry}"].clone()
    params[f"bn.{entry}"][1] = value
    with pytest.raises(ValueError, match=rf"bn\.{entry}: .*non-finite"):
        qt.fold_norms(params, [qt.NormFold("fc", "bn", 1e-5)])


def test_refuses_a_variance_that_is_not_positive():
    params = _linear_bn()
    params["bn.running_var"] = torch.tensor([1.0, -0.5, 1.0])
    with pytest.raises(ValueError, match=r"bn\.running_var: var \+ eps must be > 0 .*channel 1"):
        qt.fold_norms(params, [qt.NormFold("fc", "bn", 1e-5)])


def test_refuses_bad_arguments_by_name():
    params = _linear_bn()
    with pytest.raises(ValueError, match=r"nope\.weight: producer weight is not in params"):
        qt.fold_norms(params, [qt.NormFold("nope", "bn", 1e-5)])
    with pytest.raises(TypeError, match="params must be a mapping"):
        qt.fold_norms([1], [])
    with pytest.raises(TypeError, match="folds must be a sequence"):
        qt.fold_norms(params, "fc")
    with pytest.raises(TypeError, match=r"folds\[0\] must be a NormFold"):
        qt.fold_norms(params, ["fc"])
    with pytest.raises(ValueError, match=r"folds\[0\] \(bn\): eps must be a finite number >= 0"):
        qt.fold_norms(params, [qt.NormFold("fc", "bn", -1.0)])
    with pytest.raises(ValueError, match=r"folds\[0\] \(fc\): groups must be an int >= 1"):
        qt.fold_norms(params, [qt.NormFold("fc", "bn", 1e-5, True, 0)])
    with pytest.raises(ValueError, match=r"bn: named twice in folds"):
        qt.fold_norms(params, [qt.NormFold("fc", "bn", 1e-5), qt.NormFold("fc2", "bn", 1e-5)])
    with pytest.raises(ValueError, match=r"fc\.weight: a producer weight has at least 2 dimensions"):
        qt.fold_norms({**params, "fc.weight": torch.ones(3)}, [qt.NormFold("fc", "bn", 1e-5)])
    with pytest.raises(TypeError, match=r"fc\.weight: producer weight must be a real floating-point tensor"):
        qt.fold_norms({**params, "fc.weight": torch.ones(3, 2, dtype=torch.int32)}, [qt.NormFold("fc", "bn", 1e-5)])
    with pytest.raises(ValueError, match=r"fc\.bias: shape \(2,\), expected \(3,\)"):
        qt.fold_norms({**params, "fc.bias": torch.ones(2)}, [qt.NormFold("fc", "bn", 1e-5)])


def test_refuses_a_quantized_producer():
    params = _linear_bn()
    spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    params["fc.weight"] = qt.quantize(params["fc.weight"], qt.choose_qparams(params["fc.weight"], spec))
    with pytest.raises(TypeError, match=r"fc\.weight: producer weight must be a float torch\.Tensor \(fold norms "
                                        r"before quantizing\), got QTensor"):
        qt.fold_norms(params, [qt.NormFold("fc", "bn", 1e-5)])
