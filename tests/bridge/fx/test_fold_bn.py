"""bridge.fold_batchnorm: the folded model computes what the input model computes in eval mode.

Expected outputs are the input model's own, run in eval mode by torch (BatchNorm with its running statistics);
BatchNorm statistics and affine parameters are randomized so that a fold that drops one shows. Float32 models
agree to float32 rounding (rtol 1e-5)."""

import copy

import pytest
import torch
from torch import nn

import bridge
import qtransform as qt


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) * 2 + 0.2)
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                m.weight.copy_(torch.randn(m.num_features, generator=g))
                m.bias.copy_(torch.randn(m.num_features, generator=g))
    return model.eval()


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


class Block(nn.Module):
    """A ResNet basic block with a downsample branch: conv-bn-relu, conv-bn, + downsample(conv-bn), relu."""

    def __init__(self, cin, cout, stride=2):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class ResNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = Block(8, 16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)
        self.bn_fc = nn.BatchNorm1d(10)

    def forward(self, x):
        return self.bn_fc(self.fc(self.pool(self.layer1(self.stem(x))).flatten(1)))


def test_resnet_block_folds_every_batchnorm_and_equals_eval_mode():
    model = _randomize(ResNetish())
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    want = model(x)
    r = bridge.fold_batchnorm(model)
    assert r.folded == (("stem.0", "stem.1"), ("layer1.conv1", "layer1.bn1"), ("layer1.conv2", "layer1.bn2"),
                        ("layer1.downsample.0", "layer1.downsample.1"), ("fc", "bn_fc"))
    assert r.skipped == {} and r.untraced == {}
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in r.model.modules())
    assert isinstance(r.model.layer1.bn1, nn.Identity) and r.model.layer1.conv1.bias is not None
    _close(r.model(x), want)
    # the input model is untouched: same modules, same tensors
    assert isinstance(model.layer1.bn1, nn.BatchNorm2d) and model.layer1.conv1.bias is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not r.model.training


def test_the_folded_tree_is_the_core_fold_of_the_extracted_tree():
    model = _randomize(ResNetish(), seed=3)
    r = bridge.fold_batchnorm(model)
    folds = [qt.NormFold(p, n, model.get_submodule(n).eps) for p, n in r.folded]
    want = qt.fold_norms(bridge.extract(model), folds)
    got = bridge.extract(r.model)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    x = torch.randn(2, 3, 8, 8)
    _close(torch.func.functional_call(r.model, want, (x,)), model(x))


SEQUENTIALS = {
    "depthwise-separable": (lambda: nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
        nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
        nn.Conv2d(16, 24, 3, groups=4), nn.BatchNorm2d(24)), (2, 8, 9, 9), 3),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6), nn.ReLU(), nn.Conv1d(6, 6, 1, bias=False),
                                     nn.BatchNorm1d(6)), (3, 4, 12), 2),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
                                     nn.Conv3d(4, 4, 1, groups=2, bias=False), nn.BatchNorm3d(4)), (2, 2, 5, 5, 5), 2),
    "convtranspose2d": (lambda: nn.Sequential(nn.ConvTranspose2d(6, 4, 3, stride=2, groups=2), nn.BatchNorm2d(4),
                                              nn.ReLU(), nn.ConvTranspose2d(4, 3, 2, bias=False), nn.BatchNorm2d(3)),
                        (2, 6, 5, 5), 2),
    "linear": (lambda: nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4, bias=False),
                                     nn.BatchNorm1d(4, affine=False)), (6, 12), 2),
}


@pytest.mark.parametrize("name", list(SEQUENTIALS))
def test_sequentials_fold_and_equal_eval_mode(name):
    make, shape, n = SEQUENTIALS[name]
    model = _randomize(make(), seed=list(SEQUENTIALS).index(name))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    want = model(x)
    r = bridge.fold_batchnorm(model)
    assert len(r.folded) == n and r.skipped == {}
    _close(r.model(x), want)


class TwoUsers(nn.Module):
    """bn reads conv's output, and so does the residual add: folding would change the add's input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn2(self.conv2(self.bn(y) + y))


def test_a_batchnorm_whose_input_feeds_two_consumers_is_not_folded():
    model = _randomize(TwoUsers())
    x = torch.randn(2, 4, 6, 6)
    r = bridge.fold_batchnorm(model)
    assert r.folded == (("conv2", "bn2"),)
    assert set(r.skipped) == {"bn"} and "the output of conv has other users too (add)" in r.skipped["bn"]
    assert isinstance(r.model.bn, nn.BatchNorm2d) and r.model.conv.weight.equal(model.conv.weight)
    _close(r.model(x), model(x))


class NotTraceable(nn.Module):
    """Data-dependent control flow: symbolic_trace fails; its Sequential and its child block are searched."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU())
        self.block = Block(6, 8, stride=1)
        self.loose_conv = nn.Conv2d(8, 8, 1)
        self.loose_bn = nn.BatchNorm2d(8)

    def forward(self, x):
        x = self.block(self.features(x))
        if x.sum() > 0:
            x = x * 2
        return self.loose_bn(self.loose_conv(x))


def test_untraceable_model_folds_through_children_and_sequential_adjacency():
    model = _randomize(NotTraceable())
    x = torch.randn(2, 3, 9, 9)
    want = model(x)
    r = bridge.fold_batchnorm(model)
    assert list(r.untraced) == [""] and r.untraced[""].startswith("TraceError: ")
    assert r.folded == (("features.0", "features.1"), ("block.conv1", "block.bn1"), ("block.conv2", "block.bn2"),
                        ("block.downsample.0", "block.downsample.1"))
    assert "(in a module that did not trace)" in r.skipped["loose_bn"]  # the top forward's own conv -> bn: no graph to prove it
    _close(r.model(x), want)


def test_training_mode_is_refused_by_name_unless_allowed():
    model = _randomize(ResNetish()).train()
    with pytest.raises(ValueError, match=r"stem\.1: BatchNorm in training mode .*model\.eval\(\).*allow_training"):
        bridge.fold_batchnorm(model)
    r = bridge.fold_batchnorm(model, allow_training=True)
    assert r.model.training and len(r.folded) == 5
    x = torch.randn(3, 3, 8, 8)
    _close(r.model.eval()(x), model.eval()(x))
    with pytest.raises(TypeError, match="allow_training must be a bool"):
        bridge.fold_batchnorm(model, allow_training=1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        bridge.fold_batchnorm({"w": torch.ones(1)})


def test_batchnorm_without_running_stats_and_shared_modules_are_reported():
    shared = nn.Conv2d(3, 3, 1)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, track_running_stats=False),
                          shared, nn.BatchNorm2d(3), shared, nn.ReLU(), nn.BatchNorm2d(3)).eval()
    _randomize(model)
    x = torch.randn(2, 3, 4, 4)
    r = bridge.fold_batchnorm(model)
    assert r.folded == ()
    assert "track_running_stats=False" in r.skipped["1"]
    assert r.skipped["3"] == "2 is called at 2 places in the forward"  # the shared conv: folding it twice is wrong
    assert r.skipped["6"].startswith("its input is the output of 5 (ReLU)")
    _close(r.model(x), model(x))


def test_non_finite_statistics_are_refused_by_path():
    model = _randomize(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    model[1].running_var[2] = float("nan")
    with pytest.raises(ValueError, match=r"1\.running_var: .*non-finite"):
        bridge.fold_batchnorm(model)


W8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
WEIGHT_ONLY = qt.Recipe(type_rules={"Conv2d": W8, "Linear": W8})
W8A8 = qt.Recipe(type_rules={"Conv2d": W8, "Linear": W8}, input=qt.QuantSpec(format="int8", granularity=qt.PerTensor()))


def test_quantize_the_folded_model_and_save_reload(tmp_path):
    model = _randomize(ResNetish(), seed=7)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    folded = bridge.fold_batchnorm(model).model
    qmodel = bridge.quantize(folded, WEIGHT_ONLY)
    assert type(qmodel.layer1.conv1).__name__ == "QConv2d" and isinstance(qmodel.layer1.bn1, nn.Identity)
    y, want = qmodel(x), model(x)
    assert (y - want).abs().max() < 0.02 * want.abs().max()  # int8 weights: close to the float model
    bridge.save(qmodel, tmp_path / "q")
    back = bridge.load(tmp_path / "q", like=folded)
    assert torch.equal(back(x), y)
    # the option of bridge.quantize does the same in one call, and leaves the input alone
    one = bridge.quantize(model, WEIGHT_ONLY, fold_batchnorm=True)
    assert torch.equal(one(x), y) and isinstance(model.layer1.bn1, nn.BatchNorm2d)
    with pytest.raises(ValueError, match="fold_batchnorm=True .* inplace=True"):
        bridge.quantize(model, WEIGHT_ONLY, fold_batchnorm=True, inplace=True)
    with pytest.raises(TypeError, match="fold_batchnorm must be a bool"):
        bridge.quantize(model, WEIGHT_ONLY, fold_batchnorm="yes")


def _w8a8(model):
    calibration = [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return bridge.quantize(model, W8A8, calibration=calibration, fold_batchnorm=True)


def test_w8a8_static_activations_on_the_folded_model():
    model = _randomize(ResNetish(), seed=8)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    qmodel = _w8a8(model)
    assert "input=int8" in repr(qmodel.layer1.conv1) and isinstance(qmodel.stem[1], nn.Identity)
    y, want = qmodel(x), model(x)
    assert (y - want).abs().max() < 0.05 * want.abs().max()


def test_w8a8_folded_model_save_reload(tmp_path):
    model = _randomize(ResNetish(), seed=8)
    x = torch.randn(2, 3, 8, 8)
    qmodel = _w8a8(model)
    bridge.save(qmodel, tmp_path / "q")
    back = bridge.load(tmp_path / "q", like=bridge.fold_batchnorm(model).model)
    assert torch.equal(back(x), qmodel(x))


class Gate(nn.Module):
    """Untraceable (its forward branches on data), no parameters."""

    def forward(self, x):
        return x if x.mean() > 0 else -x


def test_sequential_adjacency_where_the_sequential_does_not_trace():
    model = _randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), Gate(), nn.Conv2d(4, 4, 1, bias=False),
                                     nn.BatchNorm2d(4), Gate(), nn.Conv2d(4, 2, 1), nn.ReLU(), nn.BatchNorm2d(2)))
    x = torch.randn(2, 3, 6, 6)
    found = bridge.fx.find_pairs(model)
    assert found.pairs == (("0", "1", "sequential"), ("3", "4", "sequential"))
    r = bridge.fold_batchnorm(model)
    assert r.folded == (("0", "1"), ("3", "4")) and list(r.untraced) == [""]
    assert "(in a module that did not trace)" in r.skipped["8"]
    _close(r.model(x), model(x))


def test_forward_hooks_keep_a_pair_unfolded():
    model = _randomize(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    model[0].register_forward_hook(lambda m, i, o: None)
    r = bridge.fold_batchnorm(model)
    assert r.folded == () and r.skipped == {"1": "0 has forward hooks (they would see the folded tensors)"}
