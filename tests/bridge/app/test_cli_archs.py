"""``qtransform quantize`` as a new user runs it, on tiny models of every family the README names
(Llama, Mistral, Qwen2, OPT, GPT-2, BERT) with every preset: quantize, save, reload with
``from_pretrained``, same logits as the quantized model the command held in memory; and every
preset on a model whose widths are not multiples of its group (padded, as the README promises).

The command runs in-process (``main([...])``), so the whole file takes seconds per architecture.
"""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import bridge
import qtransform as qt
import tiny_lm
from bridge.app.cli import main
from bridge_util import on_command_model, same_model_bound, tiny_causal_lm

# Third-party warnings only, by category and module (ours, from bridge.* and qtransform.*, stay visible):
# TorchScript's deprecation, raised when transformers is first imported (`-W default -rw` shows no other).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")


ARCHS = ("llama", "mistral", "qwen2", "opt", "gpt2", "bert")
PRESETS = tuple(qt.presets())
IDS = torch.tensor([[1, 5, 9, 2, 17, 3, 30, 4, 11, 7]])


def _save(model, directory):
    model.save_pretrained(directory)
    tiny_lm.tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    dirs = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        dirs[arch] = _save(tiny_causal_lm(arch).eval(), root / arch)
    return dirs


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory):
    """A Llama whose widths (100 and 196) are multiples of none of the presets' groups (8 ... 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=64, hidden_size=100, intermediate_size=196, num_hidden_layers=1,
                      num_attention_heads=5, num_key_value_heads=5, max_position_embeddings=64)
    return _save(LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("odd") / "odd-llama")


def _linear_weights(model) -> dict[str, tuple[int, ...]]:
    """Weights of Linear / Conv1D modules outside lm_head, found by walking the modules."""
    from transformers.pytorch_utils import Conv1D

    return {f"{name}.weight": tuple(m.weight.shape) for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, Conv1D)) and not name.startswith("lm_head")}


def _quantize_via_cli(model_dir, out, preset, monkeypatch, *extra):
    """Run the command; return (report, logits of the quantized model it held in memory)."""
    seen = {}
    on_command_model(monkeypatch, lambda qmodel: seen.update(logits=qmodel(input_ids=IDS).logits))
    rc = main(["quantize", "--in-memory", "--model", str(model_dir), "--recipe", preset, "--out", str(out), "--threads", "1", *extra])
    assert rc == 0
    return json.loads((out / "report.json").read_text()), seen["logits"]


def _stored_spec(spec, conv1d: bool):
    """The spec as stored for a weight kept (in, out) like GPT-2's Conv1D: presets mean the logical
    (out, in) layout, so groups run down axis 0 and output channels are axis 1."""
    if not conv1d:
        return spec
    g = spec.granularity
    g = dataclasses.replace(g, axis=0) if isinstance(g, qt.PerGroup) else qt.PerChannel(1) if g == qt.PerChannel(0) else g
    return dataclasses.replace(spec, granularity=g)


def _calib(preset) -> list[str]:
    """Static activation scales are calibrated, and steps such as GPTQ run on data: those presets run
    with a little calibration data."""
    p = qt.get_preset(preset)
    act = p.recipe.input
    data = any(qt.ALGORITHMS[s.name].needs is not None for s in p.steps)
    return ["--calib", "2", "--seq-len", "16"] if data or (act is not None and not act.dynamic) else []


def _reload(out):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out).eval()


def _perplexity(model, seqs: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=seqs).logits[:, :-1]
    return math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1)).item())


def _covering() -> set[tuple[str, str]]:
    """(architecture, preset) pairs that run every preset once and every architecture once per step kind
    (the presets' chain of step names): ``make test`` runs these, ``make test-long`` the whole matrix."""
    kinds: dict[tuple, list] = {}
    for preset in PRESETS:
        kinds.setdefault(tuple(s.name for s in qt.get_preset(preset).steps), []).append(preset)
    return {(ARCHS[j % len(ARCHS)], presets[j % len(presets)])
            for presets in kinds.values() for j in range(max(len(presets), len(ARCHS)))}


COVERING = _covering()
MATRIX = [pytest.param(arch, preset, id=f"{arch}-{preset}", marks=() if (arch, preset) in COVERING else pytest.mark.long)
          for arch in ARCHS for preset in PRESETS]


def test_the_covering_set_covers():
    """Every preset, and every architecture with every kind of step chain, is in ``make test``'s set."""
    assert {p for _, p in COVERING} == set(PRESETS)
    kinds = {tuple(s.name for s in qt.get_preset(p).steps) for p in PRESETS}
    for kind in kinds:
        assert {a for a, p in COVERING if tuple(s.name for s in qt.get_preset(p).steps) == kind} == set(ARCHS), kind


@pytest.mark.parametrize("arch,preset", MATRIX)
def test_every_preset_on_every_architecture_round_trips(arch, preset, model_dirs, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ckpt"
    evaluate = arch == "llama"  # one family runs the whole way, perplexity before and after included
    extra = ["--seq-len", "16", "--eval-sequences", "2"] if evaluate else ["--no-eval"]
    calib = _calib(preset)[:2] if evaluate else _calib(preset)  # --seq-len 16 is in extra already
    smooths = any(s.name in ("smoothquant", "awq") for s in qt.get_preset(preset).steps)
    rotates = any(s.name in ("rotate", "spinquant") for s in qt.get_preset(preset).steps)
    if (smooths and arch == "bert") or (rotates and arch in ("opt", "gpt2", "bert")):
        # a post-norm encoder SmoothQuant and AWQ cannot fold into, LayerNorm models no rotation commutes
        # with: refused, nothing written
        rc = main(["quantize", "--model", str(model_dirs[arch]), "--recipe", preset, "--out", str(out), *extra, *calib])
        assert rc == 1 and not out.exists()
        return
    rep, logits = _quantize_via_cli(model_dirs[arch], out, preset, monkeypatch, *extra, *calib)

    original = AutoModelForCausalLM.from_pretrained(model_dirs[arch]).eval()
    expected = _linear_weights(original)
    assert {l["path"] for l in rep["layers"]} == set(expected)
    assert {l["spec"] for l in rep["layers"]} == {str(_stored_spec(qt.get_preset(preset).spec, arch == "gpt2"))}

    loaded = _reload(out)
    with torch.no_grad():
        again = loaded(input_ids=IDS).logits
        before = original(input_ids=IDS).logits
    assert torch.equal(again, logits)
    assert not torch.equal(logits, before)  # it was quantized
    assert (logits - before).abs().max() < same_model_bound(original, preset, IDS, before)  # ... still the same model
    quantized = {n for n, m in loaded.named_modules() if isinstance(m, bridge.QLinear)}
    assert {f"{n}.weight" for n in quantized} == set(expected)
    act = qt.get_preset(preset).recipe.input  # activation quantizers survive the checkpoint
    assert {loaded.get_submodule(n).input_spec for n in quantized} == {act}
    assert len([a for a in rep["activations"] if a["role"] == "input"]) == (len(quantized) if act is not None else 0)
    if act is not None and not act.dynamic:
        assert all(a["range"][0] < 0 < a["range"][1] for a in rep["activations"])
    assert not any(loaded.get_submodule(n).output_spec for n in quantized)
    kv = qt.get_preset(preset).recipe.kv_cache  # one k_scale and one v_scale per attention layer, post-RoPE
    attention = bridge.modules.kvcache.attention_modules(loaded)
    assert len(attention) == 2
    stored = {n for n in loaded.state_dict() if n.endswith(("k_scale", "v_scale"))}
    assert stored == ({f"{a}.{r}_scale" for a in attention for r in "kv"} if kv else set())
    assert len([a for a in rep["activations"] if a["role"] in ("key", "value")]) == (4 if kv else 0)

    if evaluate:
        from bridge.app import corpus

        seqs = corpus.token_sequences(corpus.load_text("builtin", part="eval"), tiny_lm.tokenizer(), seq_len=16,
                                      max_sequences=2)
        assert rep["eval_tokens"] == seqs.numel()
        assert rep["ppl_before"] == pytest.approx(_perplexity(original, seqs), rel=1e-5)
        assert rep["ppl_after"] == pytest.approx(_perplexity(loaded, seqs), rel=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_pads_widths_that_its_group_does_not_divide(preset, odd_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ckpt"
    calib = ["--calib", "2"] if _calib(preset) else []
    rep, logits = _quantize_via_cli(odd_dir, out, preset, monkeypatch, "--seq-len", "8", "--eval-sequences", "1", *calib)
    assert len(rep["layers"]) == 7 and rep["ppl_after"] > 1
    loaded = _reload(out)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, logits)

    spec = qt.get_preset(preset).spec
    original = AutoModelForCausalLM.from_pretrained(odd_dir).eval()
    qtree = bridge.load_tree(out)
    for path, shape in _linear_weights(original).items():
        q = qtree[path]
        assert tuple(q.shape) == shape
        if isinstance(spec.granularity, qt.PerGroup):  # one scale per group, the last one partial
            assert q.qparams.scale.shape[-1] == math.ceil(shape[-1] / spec.granularity.size), path
    if preset.startswith("int4-g") and not preset.endswith("asym"):
        # symmetric int4, full range: scale = amax / 7.5 over the group's own elements (padding
        # repeats the last element, so the partial group's range is its own)
        g = spec.granularity.size
        w = original.get_parameter("model.layers.0.mlp.down_proj.weight").detach()  # (100, 196)
        want = torch.stack([w[:, i:i + g].abs().amax(1) for i in range(0, w.shape[1], g)], 1) / 7.5
        got = qtree["model.layers.0.mlp.down_proj.weight"].qparams.scale
        torch.testing.assert_close(got, want, rtol=2e-7, atol=0)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_a_kv_cache_on_any_recipe_from_the_command_line(arch, model_dirs, tmp_path, monkeypatch):
    """`--kv-cache fp8_e4m3` adds a calibrated fp8 cache to a weight-only preset: the report lists one
    key and one value range per layer, the checkpoint holds their scalar scales and reloads with them;
    without --calib, or with an unknown format, one line and nothing written."""
    out = tmp_path / "ckpt"
    assert main(["quantize", "--model", str(model_dirs[arch]), "--recipe", "int8-channel", "--kv-cache", "fp8_e4m3",
                 "--out", str(out), "--no-eval"]) == 1 and not out.exists()
    assert main(["quantize", "--model", str(model_dirs[arch]), "--recipe", "int8-channel", "--kv-cache", "fp9",
                 "--calib", "2", "--out", str(out), "--no-eval"]) == 1 and not out.exists()
    rep, logits = _quantize_via_cli(model_dirs[arch], out, "int8-channel", monkeypatch, "--kv-cache", "fp8_e4m3",
                                    "--calib", "2", "--seq-len", "16", "--no-eval")
    kv = [a for a in rep["activations"] if a["role"] in ("key", "value")]
    assert len(kv) == len(rep["activations"]) == 4 and all(a["range"][0] < 0 < a["range"][1] for a in kv)
    loaded = _reload(out)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, logits)
    attention = bridge.modules.kvcache.attention_modules(loaded)
    assert {n: t.shape for n, t in loaded.state_dict().items() if n.endswith(("k_scale", "v_scale"))} == {
        f"{a}.{r}_scale": torch.Size([]) for a in attention for r in "kv"}


@pytest.mark.parametrize("arch", ["qwen2", "opt", "gpt2", "bert"])
@pytest.mark.parametrize("min_ndim", [None, 1])
def test_hqq_through_the_api_on_models_with_biases(arch, min_ndim):
    """``bridge.quantize`` with the hqq step and a ``default`` spec: biases are not weights."""
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval()
    kw = {} if min_ndim is None else {"min_ndim": min_ndim}
    recipe = qt.Recipe(default=qt.get_preset("hqq4-g64").spec, exclude=["lm_head*"], steps=[qt.Step("hqq")], **kw)
    qmodel = bridge.quantize(model, recipe)
    weights = _linear_weights(model)
    biased = [n for n, m in model.named_modules() if f"{n}.weight" in weights and m.bias is not None]
    assert biased  # these models do have biased linear layers
    for name in {n.removesuffix(".weight") for n in weights}:
        m = qmodel.get_submodule(name)
        assert isinstance(m, bridge.QLinear), name
        if name in biased:
            assert torch.equal(m.bias, model.get_submodule(name).bias)  # left in full precision


def test_the_fast_int4_kernel_agrees_on_padded_groups():
    """int4 g128 on 192 inputs: two groups, the second one padded (64 real elements); the packed
    CPU kernel must not read them as two groups of 96."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(192, 32)
    with torch.no_grad():
        lin.weight[:, 128:] *= 100  # groups of very different ranges
    q = bridge.quantize(torch.nn.Sequential(lin), qt.get_preset("int4-g128").recipe)[0]
    x = torch.randn(4, 192)
    want = F.linear(x, qt.dequantize(q.qweight), lin.bias)
    torch.testing.assert_close(q(x), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def _smollm2_shaped(layers: int):
    """SmolLM2-135M's widths (576 hidden, 1536 intermediate: 576 is not a multiple of 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=64,
                                        tie_word_embeddings=True))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_fits_the_default_model_shapes(preset):
    """Planned on SmolLM2's shapes (meta device: no weights): every tensor's grid fits."""
    from bridge import pipeline

    with torch.device("meta"):
        model = _smollm2_shaped(2)
    plan = pipeline.plan(model, qt.get_preset(preset).recipe)
    assert len(plan.specs) == 2 * 7


def test_int4_g128_on_the_default_model_widths(tmp_path, monkeypatch):
    """The reported crash: int4-g128 on 576-wide layers."""
    torch.manual_seed(0)
    d = _save(_smollm2_shaped(1).eval(), tmp_path / "smol")
    rep, logits = _quantize_via_cli(d, tmp_path / "ckpt", "int4-g128", monkeypatch, "--no-eval")
    assert len(rep["layers"]) == 7
    with torch.no_grad():
        assert torch.equal(_reload(tmp_path / "ckpt")(input_ids=IDS).logits, logits)
    scale = bridge.load_tree(tmp_path / "ckpt")["model.layers.0.self_attn.o_proj.weight"].qparams.scale
    assert scale.shape == (576, 5)  # 4 whole groups of 128 and one of 64
