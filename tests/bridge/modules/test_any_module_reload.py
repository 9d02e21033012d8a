"""Any ``nn.Module`` saved and reloaded with identical outputs (issue 53): every module type a quantized module
replaces (Linear, Conv1d/2d/3d with grouped and depthwise, ConvTranspose1d/2d/3d, Embedding, EmbeddingBag), weight
only (int8 / int4 per channel, int4 per group) and with static W8A8 activations; a torchvision-style CNN whose
static conv input scales used not to reload (``conv1.input_scale`` stored ``[1, 1, 1, 1]``, expected ``[1, 1]``).

Which types take which activation quantizers: linear layers and convolutions take ``input`` and ``output``;
``Embedding`` and ``EmbeddingBag`` take ``output`` only -- their input is token ids, left in integers on purpose
(``input=`` skips it; an ``act_rules`` entry naming it is refused by name). Modules no quantized module replaces
(``nn.Bilinear``, norms) keep their weights in float, said in the plan's rule, or are refused by name when a rule
selects them explicitly. Calibration batches may be tensors, tuples/lists (positional inputs) or dicts (keyword
inputs), whatever the model's forward takes; another type is refused naming the batch's index and type.
"""

import pytest
import torch
from torch import nn

import qtransform as qt
import bridge
from bridge.modules.actquant import static_buffers

INT8_CH = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
INT4_CH = qt.QuantSpec(format="int4", granularity=qt.PerChannel(0))
INT4_G = {"rows": qt.QuantSpec(format="int4", granularity=qt.PerGroup(8)),  # groups of 8 features of a row
          "channels": qt.QuantSpec(format="int4", granularity=qt.PerGroup(2, axis=1))}  # of 2 input channels
A8 = qt.QuantSpec(format="int8")  # static per tensor, symmetric: scale = amax / 127.5 ("full" range)

# name: (module type, factory, example input, per-group spec, spatial dimensions of a conv's activations)
CASES = {
    "Linear": ("Linear", lambda: nn.Linear(16, 8), lambda: torch.randn(2, 5, 16), "rows", None),
    "Conv1d": ("Conv1d", lambda: nn.Conv1d(4, 8, 3, padding=1), lambda: torch.randn(2, 4, 10), "channels", 1),
    "Conv2d-reflect": ("Conv2d", lambda: nn.Conv2d(4, 8, 3, padding=1, padding_mode="reflect"),
                       lambda: torch.randn(2, 4, 6, 6), "channels", 2),
    "Conv2d-grouped": ("Conv2d", lambda: nn.Conv2d(4, 8, 3, groups=2, dilation=2), lambda: torch.randn(2, 4, 7, 7),
                       "channels", 2),
    "Conv2d-depthwise": ("Conv2d", lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False),
                         lambda: torch.randn(2, 4, 6, 6), None, 2),
    "Conv3d": ("Conv3d", lambda: nn.Conv3d(4, 8, 3, padding=1, stride=2), lambda: torch.randn(2, 4, 5, 5, 5),
               "channels", 3),
    "ConvTranspose1d": ("ConvTranspose1d", lambda: nn.ConvTranspose1d(4, 8, 3, stride=2), lambda: torch.randn(2, 4, 7),
                        "channels", 1),
    "ConvTranspose2d": ("ConvTranspose2d", lambda: nn.ConvTranspose2d(4, 8, 4, stride=2, padding=1),
                        lambda: torch.randn(2, 4, 5, 5), "channels", 2),
    "ConvTranspose2d-grouped": ("ConvTranspose2d", lambda: nn.ConvTranspose2d(4, 8, 3, groups=2, output_padding=1,
                                                                              stride=2),
                                lambda: torch.randn(2, 4, 5, 5), "channels", 2),
    "ConvTranspose3d": ("ConvTranspose3d", lambda: nn.ConvTranspose3d(4, 8, 2, stride=2),
                        lambda: torch.randn(2, 4, 3, 3, 3), "channels", 3),
    "Embedding": ("Embedding", lambda: nn.Embedding(20, 16), lambda: torch.randint(0, 20, (2, 5)), "rows", None),
    "EmbeddingBag": ("EmbeddingBag", lambda: nn.EmbeddingBag(20, 16, mode="mean"),
                     lambda: torch.randint(0, 20, (3, 4)), "rows", None),
}
QCLASS = {"Linear": bridge.QLinear, "Conv1d": bridge.QConv1d, "Conv2d": bridge.QConv2d, "Conv3d": bridge.QConv3d,
          "ConvTranspose1d": bridge.QConvTranspose1d, "ConvTranspose2d": bridge.QConvTranspose2d,
          "ConvTranspose3d": bridge.QConvTranspose3d, "Embedding": bridge.QEmbedding,
          "EmbeddingBag": bridge.QEmbeddingBag}
EMBEDDINGS = ("Embedding", "EmbeddingBag")


def _model(make):
    torch.manual_seed(0)
    return nn.Sequential(make()).eval()


def _weight_specs(case):
    kind, _, _, group, _ = CASES[case]
    out = [("int8-channel", INT8_CH), ("int4-channel", INT4_CH)]
    return out + ([("int4-group", INT4_G[group])] if group else [])


def _reload(qmodel, like, tmp_path, name="ck"):
    bridge.save(qmodel, tmp_path / name)
    return bridge.load(tmp_path / name, like=like, kernel="dequant")


def _same_state(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("case,spec_name,spec", [(c, n, s) for c in CASES for n, s in _weight_specs(c)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_weight_only_reloads_identical(case, spec_name, spec, tmp_path):
    kind, make, data, _, _ = CASES[case]
    model = _model(make)
    qmodel = bridge.quantize(model, qt.Recipe(type_rules={kind: spec}), kernel="dequant")
    assert type(qmodel[0]) is QCLASS[kind] and qmodel[0].spec == spec
    back = _reload(qmodel, lambda: _model(make), tmp_path)  # a factory gives the structure
    assert type(back[0]) is QCLASS[kind] and back[0].spec == spec
    _same_state(qmodel, back)
    x = data()
    with torch.no_grad():
        got, want, ref = back(x), qmodel(x), model(x)
    assert torch.equal(got, want)
    # the quantized module computes the float module's function (int4 per channel is coarse: a loose bound)
    bound = 0.05 if spec is INT8_CH else 0.5
    assert (got - ref).abs().max() <= bound * ref.abs().max()


def _a8_recipe(kind):
    return qt.Recipe(type_rules={kind: INT8_CH}, input=A8, output=A8)


@pytest.mark.parametrize("case", list(CASES))
def test_static_w8a8_reloads_identical(case, tmp_path):
    kind, make, data, _, spatial = CASES[case]
    model = _model(make)
    torch.manual_seed(1)
    calib = [data() for _ in range(3)]
    qmodel = bridge.quantize(model, _a8_recipe(kind), calibration=calib, kernel="dequant")
    q = qmodel[0]
    # the output scale: amax of the module's outputs (computed here by the float model) / 127.5, within the
    # weight quantization's effect on the outputs
    with torch.no_grad():
        out_amax = max(model(b).abs().max() for b in calib)
    assert torch.allclose(q.output_scale.reshape(()), out_amax / 127.5, rtol=0.05)
    if kind in EMBEDDINGS:  # token ids: no input quantizer, on purpose
        assert q.input_spec is None and not hasattr(q, "input_scale")
        assert q.output_scale.shape == (1, 1)
    else:
        in_amax = max(b.abs().max() for b in calib)  # the module's input is the data itself
        assert torch.allclose(q.input_scale.reshape(()), in_amax / 127.5, rtol=1e-6)
        want = (1, 1) if spatial is None else (1,) * (2 + spatial)  # one axis per axis of (N, C, *spatial)
        assert q.input_scale.shape == want and q.output_scale.shape == want
    back = _reload(qmodel, model, tmp_path)  # the model itself gives the structure (the current signature)
    assert back[0].input_spec == q.input_spec and back[0].output_spec == q.output_spec
    _same_state(qmodel, back)
    x = data()
    with torch.no_grad():
        assert torch.equal(back(x), qmodel(x))


@pytest.mark.parametrize("make,want", [(lambda: nn.Conv1d(3, 4, 3), (1, 1, 1)), (lambda: nn.Conv2d(3, 4, 3), (1, 1, 1, 1)),
                                       (lambda: nn.Conv3d(3, 4, 3), (1, 1, 1, 1, 1)),
                                       (lambda: nn.ConvTranspose2d(3, 4, 3), (1, 1, 1, 1)),
                                       (lambda: nn.Linear(3, 4), (1, 1))],
                         ids=["Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d", "Linear"])
def test_float_and_quantized_module_expect_the_same_scale_shape(make, want):
    """The root cause: the shapes ``load`` expects are found on the float module of ``like``, and must be those the
    quantized module stores (a float conv was taken for a token-activation module: ``[1, 1]``)."""
    float_module = make()
    qmodule = bridge.quantize(nn.Sequential(float_module), qt.Recipe(type_rules={type(float_module).__name__: INT8_CH}))[0]
    per_channel = qt.QuantSpec(format="int8", granularity=qt.PerChannel(1 if len(want) > 2 else -1))
    for spec, shape in ((A8, want), (per_channel, want[:1] + (3,) + want[2:] if len(want) > 2 else (1, 3))):
        assert static_buffers(float_module, "input", spec) == {"input_scale": (shape, torch.float32)}
        assert static_buffers(qmodule, "input", spec) == {"input_scale": (shape, torch.float32)}


class SmallCNN(nn.Module):
    """torchvision-style: conv-bn-relu stem, a grouped and a depthwise conv, pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.dw(torch.relu(self.conv2(x))))
        return self.fc(x.mean((2, 3)))


def test_cnn_with_static_activations_reloads(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    recipe = qt.Recipe(type_rules={"Conv2d": INT8_CH, "Linear": INT8_CH}, input=A8)
    calib = [torch.randn(2, 3, 16, 16) for _ in range(3)]
    qmodel = bridge.quantize(model, recipe, calibration=calib, kernel="dequant")
    assert qmodel.conv1.input_scale.shape == (1, 1, 1, 1) and qmodel.fc.input_scale.shape == (1, 1)
    assert isinstance(qmodel.bn1, nn.BatchNorm2d)  # no quantized BatchNorm: kept float
    assert torch.allclose(qmodel.conv1.input_scale.reshape(()), max(b.abs().max() for b in calib) / 127.5, rtol=1e-6)
    back = _reload(qmodel, SmallCNN, tmp_path)  # the class is a zero-argument factory
    assert back.training  # the mode of what the factory built, as for like=model: eval() for batch-norm statistics
    back.eval()
    _same_state(qmodel, back)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(back(x), qmodel(x))
        assert (back(x) - model(x)).abs().max() < 0.1 * model(x).abs().max()


def test_load_factory_forms(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    qmodel = bridge.quantize(model, INT8_CH, kernel="dequant")
    bridge.save(qmodel, tmp_path / "ck")
    calls = []

    def factory():
        calls.append(1)
        return nn.Sequential(nn.Linear(8, 4))

    back = bridge.load(tmp_path / "ck", like=factory, kernel="dequant")
    assert calls == [1] and torch.equal(back[0].weight, qmodel[0].weight)
    with pytest.raises(TypeError, match=r"^load: like must be a torch\.nn\.Module or a zero-argument callable.*int"):
        bridge.load(tmp_path / "ck", like=3)
    with pytest.raises(TypeError, match=r"^load: like is a factory, and like\(\) must build .* returned dict"):
        bridge.load(tmp_path / "ck", like=lambda: {})


def test_embedding_input_is_never_quantized():
    model = _model(lambda: nn.Embedding(20, 16))
    calib = [torch.randint(0, 20, (2, 5))]
    kept = bridge.quantize(model, qt.Recipe(type_rules={"Embedding": INT8_CH}, input=A8), calibration=calib)
    assert kept[0].input_spec is None  # input= leaves token ids alone, as documented
    assert bridge.plan(model, qt.Recipe(type_rules={"Embedding": INT8_CH}, input=A8)).activations == {}
    named = qt.Recipe(type_rules={"Embedding": INT8_CH}, act_rules={"0:input": A8})
    with pytest.raises(ValueError, match=r"^0: recipe act_rules\[0:input\] quantizes the input of an Embedding"):
        bridge.quantize(model, named, calibration=calib)
    globbed = qt.Recipe(type_rules={"Embedding": INT8_CH}, act_rules={"*:input": A8})
    assert bridge.quantize(model, globbed, calibration=calib)[0].input_spec is None


def test_a_named_activation_rule_on_a_module_left_float_is_refused_by_name():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    recipe = lambda rules: qt.Recipe(rules={"2.weight": INT8_CH}, act_rules=rules)  # noqa: E731
    with pytest.raises(ValueError, match=r"^1: recipe act_rules\[1:input\] quantizes its input, but 1 has no weight"):
        bridge.plan(model, recipe({"1:input": A8}))
    with pytest.raises(ValueError, match=r"^0: recipe act_rules\[0:output\] quantizes its output, but 0 has no weight"):
        bridge.plan(model, recipe({"0:output": A8}))
    with pytest.raises(ValueError, match=r"^9: recipe act_rules\[9:input\] .* 9 is not a module of this model"):
        bridge.plan(model, recipe({"9:input": A8}))
    p = bridge.plan(model, recipe({"2:input": A8, "*:output": A8, "1:input": None}))  # a glob may match nothing
    assert {(s.module, s.role) for s in p.activations} == {("2", "input"), ("2", "output")}


def test_unsupported_module_types_are_kept_float_or_refused_by_name():
    model = nn.Sequential(nn.Bilinear(4, 4, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    p = bridge.plan(model, qt.Recipe(default=INT8_CH))
    assert p["0.weight"].spec is None and p["0.weight"].rule == "skipped (default: not the weight of a quantizable module)"
    assert p["2.weight"].spec == INT8_CH
    with pytest.raises(ValueError, match=r"^0\.weight: recipe type_rules\[Bilinear\] selects a tensor of a Bilinear"):
        bridge.plan(model, qt.Recipe(type_rules={"Bilinear": INT8_CH}))
    with pytest.raises(ValueError, match=r"^1\.weight: recipe rules\[1\.weight\] .*not the weight of a quantizable"):
        bridge.plan(model, qt.Recipe(rules={"1.weight": qt.QuantSpec(format="int8")}, min_ndim=1))


class TwoInputs(nn.Module):
    """A forward of two inputs: ``model(x, y)`` or ``model(x=..., y=...)``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 16), nn.Conv1d(3, 16, 1), nn.Linear(16, 2)

    def forward(self, x, y):
        return self.head(torch.relu(self.a(x) + self.b(y).mean(-1)))


def _two_inputs():
    torch.manual_seed(0)
    model = TwoInputs().eval()
    torch.manual_seed(1)
    pairs = [(torch.randn(2, 8), 3 * torch.randn(2, 3, 5)) for _ in range(3)]
    recipe = qt.Recipe(type_rules={"Linear": INT8_CH, "Conv1d": INT8_CH}, input=A8)
    return model, pairs, recipe


@pytest.mark.parametrize("form", ["tuple", "list", "dict", "dataloader"])
def test_calibration_batches_of_every_form(form, tmp_path):
    model, pairs, recipe = _two_inputs()
    if form == "dataloader":  # batches of a TensorDataset of two tensors come as lists
        data = torch.utils.data.TensorDataset(torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs]))
        batches = torch.utils.data.DataLoader(data, batch_size=2)
    else:
        batches = {"tuple": pairs, "list": [list(p) for p in pairs],
                   "dict": [{"y": y, "x": x} for x, y in pairs]}[form]
    qmodel = bridge.quantize(model, recipe, calibration=batches, kernel="dequant")
    # each input's scale from its own data: amax over the batches / 127.5
    assert torch.allclose(qmodel.a.input_scale.reshape(()), max(x.abs().max() for x, _ in pairs) / 127.5, rtol=1e-6)
    assert torch.allclose(qmodel.b.input_scale.reshape(()), max(y.abs().max() for _, y in pairs) / 127.5, rtol=1e-6)
    assert qmodel.b.input_scale.shape == (1, 1, 1)
    back = _reload(qmodel, TwoInputs, tmp_path).eval()
    x, y = torch.randn(4, 8), torch.randn(4, 3, 5)
    with torch.no_grad():
        assert torch.equal(back(x, y), qmodel(x, y)) and torch.equal(back(x=x, y=y), qmodel(x, y))


def test_single_tensor_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Conv1d(4, 4, 1)).eval()
    batches = [torch.randn(2, 3, 6) for _ in range(2)]
    q = bridge.quantize(model, qt.Recipe(type_rules={"Conv1d": INT8_CH}, input=A8), calibration=batches)
    assert torch.allclose(q[0].input_scale.reshape(()), max(b.abs().max() for b in batches) / 127.5, rtol=1e-6)


@pytest.mark.parametrize("bad,name", [(3, "int"), (None, "NoneType"), ("ab", "str"), (range(2), "range")])
def test_unusable_batch_is_named_by_index_and_type(bad, name):
    model, pairs, recipe = _two_inputs()
    with pytest.raises(TypeError, match=rf"^calibration batch 2: a batch must be a tensor .*, got {name}$"):
        bridge.quantize(model, recipe, calibration=[pairs[0], pairs[1], bad])
    with pytest.raises(TypeError, match=r"^calibration batch 0: .* keys must be strings, got 0 \(int\)"):
        bridge.quantize(model, recipe, calibration=[{0: pairs[0][0], "y": pairs[0][1]}])


def test_batch_the_forward_cannot_take_is_named():
    model, pairs, recipe = _two_inputs()
    with pytest.raises(ValueError, match=r"^calibration: TwoInputs's forward fails on a calibration batch \(a tensor"):
        bridge.quantize(model, recipe, calibration=[pairs[0][0]])  # x alone: y is missing
