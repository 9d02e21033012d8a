"""ONNX export of any model: what it refuses, by module path and spec, writing nothing; its arguments; a saved
checkpoint of a model that is not a transformers one exported with ``like=`` (the float model's factory), run by
ONNX Runtime in a clean interpreter on another batch size, against ``export_module`` of the same model."""

import numpy as np
import pytest
import torch
from interop.onnx.test_any_module import CNN, MLP, RECIPES, _input, _quantize, run_ort

import bridge
import qtransform as qt
from bridge import interop
from bridge.interop.onnx import export_module

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:torch.onnx"),
              pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")]

INT8_CH = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))


def _mlp(recipe, calibrate=False):
    torch.manual_seed(0)
    calib = [_input("mlp", 4, s) for s in range(2)] if calibrate else None
    return bridge.quantize(MLP().eval(), recipe, calibration=calib)


@pytest.mark.parametrize("recipe, opset, calibrate, says", [
    # per-token dynamic int8 (the w8a8-int8-dynamic preset's inputs): DynamicQuantizeLinear is uint8 per tensor
    (qt.get_preset("w8a8-int8-dynamic").recipe, 21, False, ["fc1:input: int8", "DynamicQuantizeLinear is uint8"]),
    # dynamic int8 per tensor (symmetric): not what DynamicQuantizeLinear computes either
    (qt.Recipe(type_rules={"Linear": INT8_CH}, input=qt.QuantSpec(format="int8", dynamic=True)), 21, False,
     ["fc2:input: int8", "DynamicQuantizeLinear"]),
    (qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0))}), 18, False,
     ["fc1.weight: fp8_e4m3", "need opset 19"]),
    (RECIPES["w4g"], 20, False, ["fc3.weight: int4 g8", "int4 codes need opset 21"]),
    (qt.Recipe(type_rules={"Linear": INT8_CH, "Embedding": qt.QuantSpec(format="int8", granularity=qt.PerGroup(8))}),
     19, False, ["emb.weight: int8 g8", "per-group scales need opset 21"]),
    (qt.get_preset("mxfp4").recipe, 21, False, ["fc1.weight: mxfp4", "no ONNX element type"]),
    (qt.Recipe(type_rules={"Linear": INT8_CH}, output=qt.QuantSpec(format="int8")), 21, True,
     ["fc3:output: int8", "output quantizer"]),
])
def test_refuses_by_module_and_spec_and_writes_nothing(recipe, opset, calibrate, says, tmp_path):
    q = _mlp(recipe, calibrate)
    with pytest.raises(ValueError, match="cannot be expressed in ONNX") as e:
        export_module(q, (_input("mlp", 2, 0),), tmp_path / "out", opset=opset)
    for s in says:
        assert s in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_refuses_quantized_modules_it_cannot_trace(tmp_path):
    q = _mlp(qt.Recipe(type_rules={"Linear": INT8_CH}))
    class QOther(bridge.QLinear):  # a quantized class the export does not know
        pass
    q.fc1 = QOther(q.fc1.qweight, q.fc1.bias)
    with pytest.raises(ValueError, match="fc1: a QOther, which the ONNX export cannot trace"):
        export_module(q, (_input("mlp", 2, 0),), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_quantized_embedding_bags(tmp_path):
    """ONNX Runtime 1.32 crashes (segmentation fault) loading torch.onnx's unoptimized embedding_bag graph, float
    or quantized: refused by name, in memory and from a checkpoint."""
    net = lambda: torch.nn.Sequential(torch.nn.EmbeddingBag(20, 8, mode="mean"), torch.nn.Linear(8, 2))  # noqa: E731
    torch.manual_seed(0)
    q = bridge.quantize(net().eval(), qt.Recipe(type_rules={"EmbeddingBag": INT8_CH, "Linear": INT8_CH}))
    x = torch.randint(0, 20, (2, 4))
    with pytest.raises(ValueError, match="0: a quantized QEmbeddingBag: torch.onnx's unoptimized embedding_bag"):
        export_module(q, (x,), tmp_path / "out")
    bridge.save(q, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="0: a quantized EmbeddingBag: torch.onnx's unoptimized embedding_bag"):
        interop.export(tmp_path / "ckpt", to="onnx", out=tmp_path / "out", like=net, example_inputs=(x,))
    assert not (tmp_path / "out").exists()


def test_refuses_bad_arguments(tmp_path):
    q = _mlp(qt.Recipe(type_rules={"Linear": INT8_CH}))
    x = _input("mlp", 2, 0)
    with pytest.raises(TypeError, match="qmodel must be a torch.nn.Module"):
        export_module("model", (x,), tmp_path / "a")
    with pytest.raises(TypeError, match="example_inputs must be a tensor or a non-empty tuple"):
        export_module(q, [], tmp_path / "a")
    with pytest.raises(ValueError, match="opset must be an int from 18"):
        export_module(q, (x,), tmp_path / "a", opset=17)
    with pytest.raises(ValueError, match="its forward on example_inputs fails"):
        export_module(q, (torch.randn(2, 3),), tmp_path / "a")  # float ids
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        export_module(q, (x,), tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert not (tmp_path / "a").exists()


def test_single_tensor_input_and_overwrite(tmp_path):
    q = _mlp(qt.Recipe(type_rules={"Linear": INT8_CH}))
    out = export_module(q, _input("mlp", 2, 0), tmp_path / "o", input_names=["ids"], output_names=["scores"])
    export_module(q, _input("mlp", 2, 0), tmp_path / "o", overwrite=True)
    assert out == tmp_path / "o" and (out / "model.onnx").is_file()


def test_checkpoint_with_like_factory(tmp_path):
    """A static W8A8 CNN (BatchNorm folded) saved, then exported from the checkpoint with like=CNN: the same
    graph as export_module's of the model in memory, which ONNX Runtime runs on a batch of 5 with our outputs."""
    model, q = _quantize("cnn-folded", "w8a8")
    bridge.save(q, tmp_path / "ckpt")
    x = _input("cnn", 2, 1)
    with pytest.raises(ValueError, match="pass like="):  # not a transformers checkpoint: like= says what to trace
        interop.export(tmp_path / "ckpt", to="onnx", out=tmp_path / "no")
    with pytest.raises(ValueError, match="like= is for targets that trace"):
        interop.export(tmp_path / "ckpt", to="quark", out=tmp_path / "no", like=CNN, example_inputs=(x,))
    with pytest.raises(TypeError, match="are options of like="):
        interop.export(tmp_path / "ckpt", to="onnx", out=tmp_path / "no", example_inputs=(x,))
    with pytest.raises(TypeError, match="like must be a torch.nn.Module or a zero-argument callable"):
        interop.export(tmp_path / "ckpt", to="onnx", out=tmp_path / "no", like=3, example_inputs=(x,))
    assert not (tmp_path / "no").exists()
    folded = bridge.fold_batchnorm(CNN().eval()).model  # the float structure the checkpoint was saved from
    a = interop.export(tmp_path / "ckpt", to="onnx", out=tmp_path / "like", like=lambda: folded, example_inputs=(x,))
    b = export_module(bridge.load(tmp_path / "ckpt", like=lambda: folded, kernel="dequant"), (x,), tmp_path / "mem")
    import onnx
    ga, gb = (onnx.load(str(p / "model.onnx")).graph for p in (a, b))
    assert [n.op_type for n in ga.node] == [n.op_type for n in gb.node]
    ia, ib = ({t.name: onnx.numpy_helper.to_array(t) for t in g.initializer} for g in (ga, gb))
    assert ia.keys() == ib.keys() and all(np.array_equal(ia[k], ib[k]) for k in ia)
    x5 = _input("cnn", 5, 2)
    got = run_ort({"like": (a / "model.onnx", x5)}, tmp_path)
    with torch.no_grad():
        ours = q(x5)
    assert got["like"].shape == (5, 5)
    assert np.abs(got["like"] - ours.numpy()).max() <= 1e-5 * float(ours.abs().max())  # see test_any_module
