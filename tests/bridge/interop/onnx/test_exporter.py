"""``--to onnx``: ONNX QDQ models run by ONNX Runtime in a fresh interpreter that never imports ``bridge``,
``qtransform`` or ``torch``: the outputs of our quantized models for every architecture family, the very
codes, scales and zero points of our checkpoints in the initializers, DequantizeLinear decoding our weights
and QuantizeLinear/DequantizeLinear quantizing activations bit for bit, refusals by tree path.

Tolerance of the outputs: the graph decodes the same float32 weights as our model (checked bit for bit
below), so what remains is float32 rounding in kernels that sum in another order (MatMul, softmax,
normalization): a few ulps per operation, about 1e-6 of the outputs' scale after two layers. We allow
1e-4 of that scale, far below what one wrong code or scale moves (the quantization itself moves the outputs
by 1e-2 of it, asserted too). Static activation quantizers amplify rounding: an activation within an ulp
of a rounding boundary takes the neighbouring code in one of the two runtimes (one code moves an output by
scale x weight, ~1e-3), so their case is checked against a looser bound, and the Q/DQ pair itself bit for
bit on a tensor given to both."""

from typing import NamedTuple

import numpy as np
import pytest
import torch
from cli_util import main_cli
from interop.onnx.helpers import DISABLED, EXACT, IDS, dequant_kernel, outputs, quantize_export, run_onnx
from interop.quark.helpers import same_bits

import qtransform as qt
from bridge import interop
from bridge.interop.onnx import tensors as onnx_tensors

# torch.onnx.export's own warnings (third-party; ours stay visible): dynamic axes that share a shape constraint,
# and torch.export's pytree deprecation raised through copyreg
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:torch.onnx"),
              pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")]


INT8_CHANNEL = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
# name: (architecture, preset or recipe, needs calibration, a weight path, its DequantizeLinear axis, block)
CASES = {
    "llama-int4-g32": ("llama", "int4-g32", False, "model.layers.0.self_attn.q_proj.weight", 1, 32),
    "mistral-uint4-g32-asym": ("mistral", "int4-g32-asym", False, "model.layers.1.mlp.down_proj.weight", 1, 32),
    # int8 per channel; uint3 groups (codes held as UINT4); int4 groups of 48 (padded) with bfloat16 scales
    "qwen2-mixed": ("qwen2", qt.Recipe(type_rules={"Linear": INT8_CHANNEL}, exclude=["lm_head*"], rules={
        "*.mlp.*": qt.QuantSpec(format="uint3", granularity=qt.PerGroup(32), symmetric=False),
        "*.self_attn.o_proj.weight": qt.QuantSpec(format="int4", granularity=qt.PerGroup(48), pad=True,
                                                  scale_dtype="bfloat16")}),
                    False, "model.layers.0.self_attn.k_proj.weight", 0, None),
    "opt-fp8-w8a8": ("opt", "fp8-w8a8", True, "model.decoder.layers.0.fc1.weight", 0, None),  # static fp8 inputs
    # Conv1D weights are stored (in, out): groups of input features run along axis 0
    "gpt2-uint4-g32-asym": ("gpt2", "int4-g32-asym", False, "transformer.h.0.attn.c_attn.weight", 0, 32),
    "bert-int8-channel": ("bert", qt.Recipe(type_rules={"Linear": INT8_CHANNEL}, exclude=["cls.*"]), False,
                          "bert.encoder.layer.1.attention.self.query.weight", 0, None),
    "llama-w8a8-int8": ("llama", "w8a8-int8", True, "model.layers.1.mlp.up_proj.weight", 0, None),
}
_SLOW = {"opt-fp8-w8a8"}  # about 25 s: calibrating fp8 inputs on OPT


def _params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in names]


_SITE = "model.layers.0.self_attn.q_proj"  # the W8A8 case's activation quantizer checked on its own


class Case(NamedTuple):
    onnx: torch.Tensor        # ONNX Runtime's first output
    ours: torch.Tensor        # our quantized model's (dequant kernel: float32 F.linear, as the graph)
    float: torch.Tensor       # the float model's
    weight: np.ndarray        # ONNX Runtime's DequantizeLinear output of the case's weight
    piece: np.ndarray | None  # its Q/DQ output of _ACT (the W8A8 case)
    names: list
    ckpt: object
    out: object


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Each case quantized, saved, exported and run by ONNX Runtime (in one clean process) on first use."""
    done = {}

    def get(name):
        if name not in done:
            arch, recipe, calib, path, _, _ = CASES[name]
            tmp = tmp_path_factory.mktemp(name)
            model, qmodel, ckpt, out = quantize_export(arch, recipe, tmp, calib=calib)
            pieces = [("", path, None)]
            if name == "llama-w8a8-int8":
                pieces.append((_act_input(out / "model.onnx"), f"{_SITE}.input_dequantized", _ACT))
            got = run_onnx({name: {"model": out / "model.onnx", "ids": IDS, "options": EXACT, "disabled": DISABLED,
                                   "pieces": pieces}}, tmp)
            assert name + ":error" not in got, str(got[name + ":error"])
            done[name] = Case(torch.from_numpy(got[name]), outputs(dequant_kernel(qmodel)), outputs(model),
                              got[f"{name}:piece0"], got.get(f"{name}:piece1"), list(got[name + ":outputs"]), ckpt, out)
        return done[name]
    return get


_ACT = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)) * 3


def _act_input(model_path) -> str:
    import onnx
    graph = onnx.load(str(model_path)).graph
    return next(n.input[0] for n in graph.node if n.op_type == "QuantizeLinear" and n.output[0].startswith(_SITE))


@pytest.mark.parametrize("name", _params(CASES))
def test_onnx_runtime_gives_our_outputs(name, cases):
    case = cases(name)
    assert case.names[0] == "logits"  # causal LMs and BERT's masked LM alike
    scale = case.ours.abs().max().item()
    diff = (case.onnx - case.ours).abs().max().item()
    moved = (case.float - case.ours).abs().max().item()  # what the quantization did
    if CASES[name][2]:  # static activation quantizers: codes flip at rounding boundaries (module docstring)
        assert diff <= 2e-2 * scale and moved > 3 * diff, (diff, moved, scale)
    else:
        assert diff <= 1e-4 * scale and moved > 100 * diff, (diff, moved, scale)


@pytest.mark.parametrize("name", _params(CASES))
def test_dequantize_linear_decodes_our_weights_bit_for_bit(name, cases):
    case = cases(name)
    path = CASES[name][3]
    q = interop.read_source(case.ckpt).tree[path]
    assert same_bits(torch.from_numpy(case.weight), qt.dequantize(q))


def test_quantize_linear_is_our_activation_quantizer(cases):
    case = cases("llama-w8a8-int8")
    tree = interop.read_source(case.ckpt).tree
    spec = interop.read_source(case.ckpt).meta.activations[qt.Site(_SITE, "input")]
    scale = tree[f"{_SITE}.input_scale"]
    want = torch.clamp(torch.round(_ACT / scale.reshape(())), -128, 127) * scale.reshape(())  # int8, full range
    assert spec.format == "int8" and spec.symmetric
    got = torch.from_numpy(case.piece)
    assert got.dtype == want.dtype and torch.equal(got, want)  # value for value (ONNX gives +0 where torch rounds to -0)
    assert torch.equal(qt.fake_quantize(_ACT, qt.QParams(spec=spec, scale=scale.reshape(1, 1, 1))), got)  # ours, too
    assert (want != _ACT).float().mean() > 0.9  # it did quantize


def _initializers(out):
    import onnx
    from onnx import numpy_helper
    model = onnx.load(str(out / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    nodes = {n.output[0]: n for n in model.graph.node}
    return model, inits, nodes, numpy_helper


@pytest.mark.parametrize("name", _params(["llama-int4-g32", "mistral-uint4-g32-asym", "gpt2-uint4-g32-asym",
                                          "opt-fp8-w8a8", "llama-w8a8-int8", "qwen2-mixed"]))
def test_initializers_hold_our_codes_scales_and_zero_points(name, cases):
    from onnx import TensorProto
    case = cases(name)
    source = interop.read_source(case.ckpt)
    model, inits, nodes, nh = _initializers(case.out)
    want_type = {"int4": TensorProto.INT4, "uint4": TensorProto.UINT4, "uint3": TensorProto.UINT4,
                 "int8": TensorProto.INT8, "fp8_e4m3": TensorProto.FLOAT8E4M3FN}
    scale_type = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16}
    assert source.meta.entries
    for path, entry in source.meta.entries.items():
        q = source.tree[path]
        assert path not in inits  # no float copy of a quantized weight
        codes = inits[f"{path}_quantized"]
        assert codes.data_type == want_type[entry.spec.format] and tuple(codes.dims) == tuple(q.shape)
        got = nh.to_array(codes)
        if entry.spec.format.startswith("fp8"):
            assert same_bits(torch.from_numpy(got.view(np.uint8).copy()).view(torch.float8_e4m3fn), q.codes)
        else:
            bits = entry.spec.fmt.codec.bits
            mine = qt.unpack(q.codes, bits, q.width, signed=entry.spec.format == "int4") if bits < 8 else q.codes
            assert np.array_equal(got.astype(np.int16), mine.numpy().astype(np.int16)), path
        scale = inits[f"{path}_scale"]
        assert scale.data_type == scale_type[q.qparams.scale.dtype]  # bfloat16 scales stay bfloat16 (a Cast follows)
        assert np.array_equal(nh.to_array(scale).astype(np.float32).reshape(-1), q.qparams.scale.float().reshape(-1).numpy())
        zp = inits.get(f"{path}_zero_point")
        if q.qparams.zero_point is not None:
            assert np.array_equal(nh.to_array(zp).astype(np.int16).reshape(-1), q.qparams.zero_point.reshape(-1).numpy())
        else:
            assert zp is None  # signed symmetric and fp8: ONNX's default zero point 0
        dq = nodes[path]
        attrs = {a.name: a.i for a in dq.attribute}
        if path == CASES[name][3]:
            assert attrs.get("axis") == CASES[name][4] and attrs.get("block_size") == CASES[name][5], attrs
    props = {p.key for p in model.metadata_props}
    assert {"qtransform.weights", "qtransform.activations"} <= props
    assert (case.out / "config.json").is_file()


def test_tied_quantized_embeddings_are_one_dequantize(tmp_path):
    """A quantized input embedding tied to the output projection: the graph holds one copy of the codes,
    feeding both the Gather and the MatMul."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    recipe = qt.Recipe(type_rules={"Linear": INT8_CHANNEL, "Embedding": INT8_CHANNEL})
    model, qmodel, ckpt, out = quantize_export(model, recipe, tmp_path)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(interop.read_source(ckpt).meta.entries)
    _, inits, _, _ = _initializers(out)
    assert sum(n.endswith(("embed_tokens.weight_quantized", "lm_head.weight_quantized")) for n in inits) == 1
    got = run_onnx({"tied": {"model": out / "model.onnx", "ids": IDS, "options": EXACT}}, tmp_path)
    ours = outputs(dequant_kernel(qmodel))
    assert (torch.from_numpy(got["tied"]) - ours).abs().max() <= 1e-4 * ours.abs().max()


def test_what_onnx_holds():
    """The table of the module docstring of :mod:`bridge.interop.onnx.tensors`, spec by spec."""
    g32, ch = qt.PerGroup(32), qt.PerChannel(0)
    exact = [qt.QuantSpec(format="int4", granularity=g32), qt.QuantSpec(format="uint4", granularity=g32, symmetric=False),
             qt.QuantSpec(format="uint3", granularity=g32, symmetric=False), INT8_CHANNEL,
             qt.QuantSpec(format="uint8", symmetric=False), qt.QuantSpec(format="fp8_e4m3", granularity=ch),
             qt.QuantSpec(format="fp8_e5m2"), qt.QuantSpec(format="int4", granularity=g32, scale_dtype="float16")]
    no = [qt.get_preset("hqq4-g64").recipe.type_rules[0][1], qt.get_preset("nvfp4").recipe.type_rules[0][1],
          qt.get_preset("mxfp4").recipe.type_rules[0][1], qt.QuantSpec(format="nf4", granularity=qt.PerGroup(64)),
          qt.QuantSpec(format="int8", granularity=qt.PerBlock((32, 32)))]
    assert [onnx_tensors.judge(s).kind for s in exact] == ["exact"] * len(exact)
    assert [onnx_tensors.judge(s).kind for s in no] == ["no"] * len(no)
    act = qt.QuantSpec(format="int8")
    assert onnx_tensors.judge(act, "input").kind == "exact"
    assert onnx_tensors.judge(act.replace(dynamic=True), "input").kind == "no"
    assert onnx_tensors.judge(act.replace(symmetric_range="restricted"), "input").kind == "no"  # clamps to [-127, 127]
    assert onnx_tensors.judge(act, "output").kind == "no" and onnx_tensors.judge(act, "key").kind == "no"


@pytest.mark.parametrize("recipe, path", [("hqq4-g64", "model.layers.1.mlp.up_proj.weight: uint4 g64 asym(float zp)"),
                                          ("nvfp4", "model.layers.0.self_attn.o_proj.weight: nvfp4"),
                                          ("w8a8-int8-dynamic", "model.layers.0.mlp.down_proj:input: int8")])
def test_refuses_what_onnx_cannot_hold_and_writes_nothing(recipe, path, tmp_path):
    import bridge
    from interop.compressed_tensors.helpers import tiny
    qmodel = bridge.quantize(tiny("llama"), qt.get_preset(recipe).recipe)
    bridge.save(qmodel, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="cannot be expressed") as e:
        interop.export(tmp_path / "ckpt", to="onnx", out=tmp_path / "out")
    assert path in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the command (main(argv), in this process) quantizes, saves and exports
def test_cli_quantize_and_export_to_onnx(tiny_llama_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    res = main_cli("quantize", "--model", str(tiny_llama_dir), "--recipe", "int4-g32-asym", "--no-eval", "--out",
                   str(ckpt))
    assert res.returncode == 0, res.stderr
    res = main_cli("export", str(ckpt), "--to", "onnx", "--out", str(tmp_path / "onnx"))
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout
    assert sorted(p.name for p in (tmp_path / "onnx").iterdir()) == \
        sorted(["model.onnx", "config.json", *[p.name for p in tiny_llama_dir.iterdir()
                                                  if p.name in interop.EXTRA_FILES]])
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(0))
    got = run_onnx({"cli": {"model": tmp_path / "onnx" / "model.onnx", "ids": ids, "options": EXACT}}, tmp_path)
    assert "cli:error" not in got and got["cli"].shape == (1, 9, 49152)
