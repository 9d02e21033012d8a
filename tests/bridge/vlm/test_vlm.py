"""Vision-language models from the command line (issue 51, part 3): loaded with the class their config names (the
vision tower and projector kept, the config's own type written back), the language model quantized, the towers
kept in float by default and said so in the report, calibrated on text, streamed to the same bytes, reloaded by
transformers to the logits of the model quantized in memory. Expected tensors come from the input's own file."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM

import bridge
import qtransform as qt
import tiny_lm
from bridge.arch import towers
from bridge.stream.inventory import take
from cli_util import main_cli
from tiny_vlm import build_tiny

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
TYPES = ("llava", "llava_next", "qwen3_5", "qwen3_vl", "qwen3_vl_moe", "gemma3", "smolvlm", "idefics3", "mistral3", "mllama")
CALIBRATED = ("llava", "qwen3_5", "mllama")
IDS = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))


def _save(model_type, directory):
    model = build_tiny(model_type, model_class=getattr(transformers, VLM[model_type]))
    model.save_pretrained(directory)
    tiny_lm.tokenizer().save_pretrained(directory)
    return model


def _tensors(directory) -> dict:
    files = sorted(directory.glob("*.safetensors"))
    return {n: t for f in files for n, t in load_file(f).items()}


@pytest.fixture(scope="module", params=TYPES)
def vlm(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = _save(request.param, root / "src")
    outs = {}
    for driver in ("--in-memory", "--stream"):
        res = main_cli("quantize", "--model", root / "src", "--recipe", "int4-g32", "--out", root / driver, "--no-eval",
                       driver)
        assert res.returncode == 0, res.stderr
        outs[driver] = root / driver
    return request.param, model, root / "src", outs


def test_the_language_model_is_quantized_and_the_towers_kept(vlm):
    model_type, model, src, outs = vlm
    cls = type(model).__name__
    cfg = json.loads((outs["--in-memory"] / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["architectures"] == [cls]  # not the text-only type
    parts = towers(model)
    assert parts, f"{cls}: no tower found"
    stored, written = _tensors(src), _tensors(outs["--in-memory"])
    quantized = set(cfg["quantization_config"]["tensors"])
    decoder = next(n for n, m in model.named_modules() if m is model.get_decoder())
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(decoder)}
    assert linears and linears <= quantized  # every linear of the language model
    target = take(src, model).loaded  # stored name -> model path (transformers renames LLaVA's on load)
    tower = {n: target[n] for n in stored if any(target[n].startswith(t + ".") for t in parts)}
    assert tower and not set(tower.values()) & quantized
    for n, path in tower.items():  # kept as stored, bit for bit
        assert torch.equal(written[path], stored[n]), n
    report = json.loads((outs["--in-memory"] / "report.json").read_text())
    for t in parts:  # each tower with a linear layer (Gemma-3's projector is a bare matrix: no module to quantize)
        if not any(isinstance(m, torch.nn.Linear) for m in model.get_submodule(t).modules()):
            continue
        assert any(f"default: {t}, a tower or projector" in note for note in report["notes"]), (t, report["notes"])


def test_streamed_bytes_equal_the_in_memory_ones(vlm):
    _, _, _, outs = vlm
    a, b = _tensors(outs["--in-memory"]), _tensors(outs["--stream"])
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_reloaded_logits_are_those_of_the_model_quantized_in_memory(vlm):
    model_type, model, src, outs = vlm
    cls = type(model)
    want = bridge.quantize(cls.from_pretrained(src).eval(), qt.get_preset("int4-g32").recipe)
    got = cls.from_pretrained(outs["--in-memory"]).eval()
    with torch.no_grad():
        torch.testing.assert_close(got(IDS).logits, want(IDS).logits, rtol=1e-4, atol=1e-4)


def test_a_glob_rule_quantizes_a_tower():
    model = build_tiny("llava", model_class=transformers.LlavaForConditionalGeneration)
    spec = qt.get_preset("int4-g32").recipe.type_rules[0][1]
    plan = bridge.plan(model, qt.Recipe(type_rules={"Linear": spec}, rules={"model.vision_tower.*proj.weight": spec}))
    tower = [p for p in plan if p.startswith("model.vision_tower.") and p.endswith("proj.weight")]
    assert tower and all(plan[p].spec == spec for p in tower)


@pytest.mark.parametrize("model_type", CALIBRATED)
@pytest.mark.parametrize("driver", ["--in-memory", "--stream"])
def test_calibrated_on_text_from_the_command(model_type, driver, tmp_path):
    model = _save(model_type, tmp_path / "src")
    res = main_cli("quantize", "--model", tmp_path / "src", "--recipe", "gptq4-g64", "--calib", "2", "--seq-len", "32",
                   "--out", tmp_path / "out", "--no-eval", driver)
    assert res.returncode == 0, res.stderr
    blocks = bridge.calibrate.find_blocks(model)
    decoder = next(n for n, m in model.named_modules() if m is model.get_decoder())
    assert all(b.startswith(decoder + ".") for b in blocks)  # the language model's layers, not the tower's
    got = type(model).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.isfinite(got(IDS).logits).all()
