"""ONNX QDQ export of any quantized model (issue 53): ``bridge.interop.onnx.export_module`` and
``bridge.interop.export(ckpt, to="onnx", like=...)`` for a small CNN (BatchNorm folded or not, ReLU, residual add,
pooling, linear head), a Conv1d model, a ConvTranspose2d decoder and an MLP over embeddings, each weight-only int8
per channel, weight-only int4 per group (opset 21 ``block_size``), static W8A8 (int8 per-channel weights, int8
per-tensor inputs) and dynamic uint8 per-tensor inputs. ONNX Runtime runs every export in one fresh interpreter
that never imports ``torch``, ``bridge`` or ``qtransform``, on a batch of 3 (the exports traced a batch of 2).

Tolerance. The graph decodes our codes with our scales (checked bit for bit below) into the float32 weights our
``dequant`` kernel uses, so ONNX Runtime and we compute the same float32 function, only summing in another order.
A float32 dot product of ``K`` terms reordered moves by at most ``2 K u sum|w x|`` (``u = 2**-24``, Higham's
``gamma_K`` twice); with ``K <= 72`` here and ``sum|w x|`` bounded by ``|W|_inf |x|_inf`` layer by layer, we allow
``REORDER = 2 * 72 * 2**-24 * gain`` of the output scale, ``gain`` the product of the layers' infinity norms (+1
per layer for the residual and identity paths). Activation quantizers add one thing: a value that a reordered sum
puts on the other side of a rounding tie (QuantizeLinear and we both round half to even, on inputs that differ in
the last ulp) takes the neighbouring code: one step of that layer's input scale, carried to the output by the gain
of the layers after it. We allow one such flip per quantized layer (``bounds``); in practice none occurs.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import bridge
import qtransform as qt
from bridge.interop.onnx import export_module

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:torch.onnx"),
              pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")]


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)  # depthwise
        self.pw = nn.Conv2d(8, 8, 1)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 5)
        with torch.no_grad():  # a BatchNorm that does something when folded or run
            self.bn1.running_mean.uniform_(-0.2, 0.2), self.bn1.running_var.uniform_(0.5, 2), self.bn1.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = h + self.pw(torch.relu(self.dw(h)))  # residual add
        return self.fc(self.pool(h).flatten(1))


class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.fc = nn.Conv1d(4, 8, 3, padding=1), nn.Conv1d(8, 8, 3, groups=2), nn.Linear(8, 3)

    def forward(self, x):  # (N, 4, L)
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean(-1))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.up1 = nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1)
        self.up2 = nn.ConvTranspose2d(4, 2, 2, stride=2, groups=2)

    def forward(self, z):  # (N, 16) -> (N, 2, 8, 8)
        return self.up2(torch.relu(self.up1(torch.relu(self.fc(z)).reshape(-1, 8, 2, 2))))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, ids):  # (N, T) token ids
        h = self.emb(ids).mean(1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(h)))))


def _input(name, batch, seed):
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randint(0, 20, (batch, 6), generator=g)
    shape = {"cnn": (3, 8, 8), "cnn-folded": (3, 8, 8), "conv1d": (4, 10), "decoder": (16,)}[name]
    return torch.randn(batch, *shape, generator=g)


MODELS = {"cnn": CNN, "cnn-folded": CNN, "conv1d": Conv1dNet, "decoder": Decoder, "mlp": MLP}
INT8_CH = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
LAYERS = ("Conv1d", "Conv2d", "ConvTranspose2d", "Linear", "Embedding")
RECIPES = {
    "w8": qt.Recipe(type_rules={t: INT8_CH for t in LAYERS}),
    # groups of 4 input channels of a conv (conv1's 3 padded to one group), 8 features of a linear/embedding row
    "w4g": qt.Recipe(type_rules={**{t: qt.QuantSpec(format="int4", granularity=qt.PerGroup(4, axis=1), pad=True)
                                    for t in LAYERS[:3]},
                                 "Linear": qt.QuantSpec(format="int4", granularity=qt.PerGroup(8)),
                                 "Embedding": qt.QuantSpec(format="uint4", granularity=qt.PerGroup(8), symmetric=False)}),
    "w8a8": qt.Recipe(type_rules={t: INT8_CH for t in LAYERS}, input=qt.QuantSpec(format="int8")),
    "dyn": qt.Recipe(type_rules={t: INT8_CH for t in LAYERS},
                     input=qt.QuantSpec(format="uint8", symmetric=False, dynamic=True)),
}
#: ONNX Runtime's default graph rewrites turn a QDQ graph into integer kernels that compute otherwise (u8s8
#: products that saturate on AVX2 without VNNI); these keep the graph's float32 semantics.
EXACT = {"session.qdq_matmulnbits_accuracy_level": "1", "session.disable_quant_qdq": "1"}

_RUN = r"""
import json, sys
import numpy as np, onnxruntime as ort
cases, out = json.load(open(sys.argv[1])), {}
for name, c in cases.items():
    try:
        so = ort.SessionOptions()
        for k, v in c["options"].items():
            so.add_session_config_entry(k, v)
        s = ort.InferenceSession(c["model"], so, providers=["CPUExecutionProvider"])
        out[name] = s.run(None, {s.get_inputs()[0].name: np.load(c["x"])})[0]
    except Exception as e:
        out[name + ":error"] = np.array(f"{type(e).__name__}: {e}")
assert not [m for m in sys.modules if m.split(".")[0] in ("bridge", "qtransform", "torch")], "torch was imported"
np.savez(sys.argv[2], **out)
"""


def run_ort(cases: dict, tmp) -> dict:
    """``{name: first output}`` (or ``name + ":error"``) of ONNX Runtime on ``{name: (model path, input)}``."""
    spec = {}
    for name, (model, x) in cases.items():
        np.save(tmp / f"{name}.npy", x.numpy())
        spec[name] = {"model": str(model), "x": str(tmp / f"{name}.npy"), "options": EXACT}
    (tmp / "cases.json").write_text(json.dumps(spec))
    res = subprocess.run([sys.executable, "-c", _RUN, str(tmp / "cases.json"), str(tmp / "out.npz")],
                         capture_output=True, text=True, cwd=tmp, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with np.load(tmp / "out.npz") as f:
        return {k: f[k] for k in f.files}


def _quantize(model_name, recipe_name):
    torch.manual_seed(0)
    model = MODELS[model_name]().eval()
    calib = [_input(model_name, 4, s) for s in range(3)] if recipe_name == "w8a8" else None
    q = bridge.quantize(model, RECIPES[recipe_name], calibration=calib, kernel="dequant",
                        fold_batchnorm=model_name == "cnn-folded")
    return model, q


def _norm_inf(m) -> tuple[float, int]:
    """``(norm, K)``: a layer's infinity norm as an operator (the largest sum of |weights| feeding one output) and
    the most terms one output sums (its fan-in)."""
    w = m.dequantized_weight(torch.float32).abs()
    if isinstance(m, (bridge.QConvTranspose1d, bridge.QConvTranspose2d, bridge.QConvTranspose3d)):
        w = w.transpose(0, 1)  # (in, out/groups, *k): an output sums over inputs and taps (at most all of them)
    rows = w.reshape(w.shape[0], -1)
    return float(rows.sum(1).max()), rows.shape[1]


def bounds(qmodel, x) -> tuple[float, float]:
    """``(reorder, flips)``: the bounds of the module docstring for ``qmodel`` on ``x``, as output magnitudes.
    Layer ``l`` (input magnitude ``a``, norm ``|W|``, fan-in ``K``) errs by at most ``2 (K + 2) u |W| a`` (its sum,
    plus the pooling or mean after it), and one code flip of its input by ``step |W|``; both reach the output
    multiplied by ``gain`` = the product of ``1 + |W_j|`` over the layers after it, times every BatchNorm's
    largest ``|gamma| / sqrt(var + eps)`` (the embedding lookup is exact and sums nothing)."""
    layers = [m for m in qmodel.modules() if isinstance(m, (bridge.QLinear, bridge.QConv1d, bridge.QConv2d,
                                                            bridge.QConvTranspose2d))]
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.__setitem__(m, (float(a[0].abs().max()),
                                                                           m.input_qparams(a[0])))) for m in layers]
    with torch.no_grad():
        qmodel(x)
    for h in hooks:
        h.remove()
    bn = [float((b.weight.abs() / (b.running_var + b.eps).sqrt()).max()) for b in qmodel.modules()
          if isinstance(b, nn.BatchNorm2d)]
    norms = [_norm_inf(m) for m in layers]
    reorder = flips = 0.0
    for i, m in enumerate(layers):
        gain = float(np.prod([1 + n for n, _ in norms[i + 1:]])) * float(np.prod([max(1.0, g) for g in bn]))
        (norm, k), (a, qp) = norms[i], seen[m]
        reorder += 2 * (k + 2) * 2.0 ** -24 * norm * a * gain
        flips += 0.0 if qp is None else float(qp.scale.max()) * norm * gain
    return reorder, flips


CASES = [(m, r) for m in MODELS for r in RECIPES]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every (model, recipe) quantized, exported on a batch of 2 and run by ONNX Runtime on a batch of 3."""
    tmp = tmp_path_factory.mktemp("any")
    done, runs = {}, {}
    for m, r in CASES:
        model, q = _quantize(m, r)
        out = export_module(q, (_input(m, 2, 7),), tmp / f"{m}-{r}")
        x = _input(m, 3, 11)
        done[m, r] = (model, q, out, x)
        runs[f"{m}-{r}"] = (out / "model.onnx", x)
    got = run_ort(runs, tmp)
    return {k: (*v, got.get(f"{k[0]}-{k[1]}"), got.get(f"{k[0]}-{k[1]}:error")) for k, v in done.items()}


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{r}" for m, r in CASES])
def test_onnx_runtime_gives_our_outputs_on_another_batch(case, exported):
    model, q, out, x, got, error = exported[case]
    assert error is None, str(error)
    with torch.no_grad():
        ours, ref = q(x), model(x)
    assert got.shape == tuple(ours.shape) and got.shape[0] == 3
    reorder, flips = bounds(q, x)
    diff = float(np.abs(got - ours.numpy()).max())
    assert diff <= reorder + flips, (diff, reorder, flips)
    # the graph computes the quantized model, not the float one: ONNX Runtime's outputs moved from the float
    # model's as ours did, by far more than they differ from ours (worst-case bounds are loose: the codes
    # themselves are checked bit for bit below)
    moved = float(np.abs(got - ref.numpy()).max())
    assert moved > 100 * diff and moved > 0.5 * float((ours - ref).abs().max()), (moved, diff)


def _graph(out):
    import onnx
    model = onnx.load(str(out / "model.onnx"))
    return model, {t.name: t for t in model.graph.initializer}, {n.output[0]: n for n in model.graph.node}


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{r}" for m, r in CASES])
def test_dequantize_linear_holds_our_codes_bit_for_bit(case, exported):
    from onnx import TensorProto, numpy_helper
    _, q, out, _, _, _ = exported[case]
    model, inits, nodes = _graph(out)
    ops = [n.op_type for n in model.graph.node]
    layers = {n: m for n, m in q.named_modules() if isinstance(m, bridge.QModule)}
    assert layers and ops.count("DequantizeLinear") >= len(layers)
    for name, m in layers.items():
        path, w = f"{name}.weight", m.qweight
        assert path not in inits  # no float copy of the weight
        codes = inits[f"{path}_quantized"]
        signed = w.spec.fmt.codec.signed
        bits = 4 if w.spec.fmt.codec.bits <= 4 else 8
        assert codes.data_type == {(4, True): TensorProto.INT4, (4, False): TensorProto.UINT4,
                                   (8, True): TensorProto.INT8, (8, False): TensorProto.UINT8}[bits, signed]
        mine = qt.unpack(w.codes, w.spec.fmt.codec.bits, w.width, signed=signed) if bits == 4 else w.codes
        got = numpy_helper.to_array(codes).astype(np.int16)
        assert got.shape == tuple(w.shape) and np.array_equal(got, mine.numpy().astype(np.int16)), path
        scale = numpy_helper.to_array(inits[f"{path}_scale"])
        assert scale.dtype == np.float32 and np.array_equal(scale.reshape(-1), w.qparams.scale.reshape(-1).numpy())
        if w.qparams.zero_point is not None:
            zp = numpy_helper.to_array(inits[f"{path}_zero_point"]).astype(np.int16).reshape(-1)
            assert np.array_equal(zp, w.qparams.zero_point.reshape(-1).numpy().astype(np.int16))
        attrs = {a.name: a.i for a in nodes[path].attribute}
        assert nodes[path].op_type == "DequantizeLinear"
        if case[1] == "w4g":
            g = w.spec.granularity
            assert attrs == {"axis": g.axis % len(w.shape), "block_size": g.size}, (path, attrs)
        else:
            assert attrs == {"axis": 0}, (path, attrs)
    acts = [m for m in layers.values() if m.input_spec is not None]
    if case[1] == "w8a8":
        assert acts and ops.count("QuantizeLinear") == len(acts)
        for name, m in layers.items():
            if m.input_spec is not None:
                s = numpy_helper.to_array(inits[f"{name}.input_scale"])
                assert s.shape == () and s == m.input_scale.reshape(()).numpy()
    elif case[1] == "dyn":
        assert acts and ops.count("DynamicQuantizeLinear") == len(acts) and "QuantizeLinear" not in ops
    else:
        assert not acts and "QuantizeLinear" not in ops and "DynamicQuantizeLinear" not in ops
    assert "BatchNormalization" in ops if case[0] == "cnn" else "BatchNormalization" not in ops
