"""Image-text calibration from the command line (issue 51, part 3): a vision-language model with its processor is
calibrated on images through that processor (synthetic ones by default, said in the report; a directory with
captions; a JSONL), in memory and streamed to the same bytes; the checkpoint reloads to the logits of the model
quantized from Python on the same image batches, which differ from a text-only calibration's."""

import json
import types

import pytest
import torch
import transformers
from safetensors.torch import load_file

import bridge
import qtransform as qt
import tiny_lm
from bridge.app import images
from bridge_util import on_command_model
from cli_util import main_cli, one_line_error
from tiny_vlm import build_tiny

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
IDS = torch.randint(0, 50, (1, 10), generator=torch.Generator().manual_seed(0))


def tiny_llava(directory):
    """A tiny LLaVA (32-pixel images, 8-pixel patches: 16 image tokens) saved with its processor."""
    tok = tiny_lm.tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image = tok.convert_tokens_to_ids("<image>")
    model = build_tiny("llava", model_class=transformers.LlavaForConditionalGeneration, image_token_index=image)
    proc = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tok, patch_size=8, vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        num_additional_image_tokens=1, image_token="<image>")
    model.save_pretrained(directory)
    proc.save_pretrained(directory)
    return model, image


def smolvlm_shaped(directory, *, real: bool):
    """Idefics3 (SmolVLM's architecture) with its processor: SmolVLM-256M's shapes with ``real``, else tiny."""
    tok = tiny_lm.tokenizer()
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    image = tok.convert_tokens_to_ids("<image>")
    shapes = {}
    if real:  # SmolVLM-256M: SmolLM2-135M's text model, a 12-layer SigLIP tower on 512-pixel images, scale factor 4
        shapes = dict(scale_factor=4,
                      text_config=dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, vocab_size=4096, head_dim=64),
                      vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                         num_attention_heads=12, image_size=512, patch_size=16))
    model = build_tiny("idefics3", model_class=transformers.Idefics3ForConditionalGeneration, image_token_id=image,
                       **shapes)
    vc = model.config.vision_config
    seq = (vc.image_size // vc.patch_size) ** 2 // model.config.scale_factor ** 2
    ip = transformers.Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": vc.image_size},
                                             max_image_size={"longest_edge": vc.image_size})
    transformers.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=seq).save_pretrained(directory)
    model.save_pretrained(directory)
    return model, image, seq


def _tensors(directory):
    return {n: t for f in sorted(directory.glob("*.safetensors")) for n, t in load_file(f).items()}


def _quantize(src, out, *args):
    res = main_cli("quantize", "--model", src, "--recipe", "gptq4-g64", "--calib", "2", "--seq-len", "32",
                   "--no-eval", "--out", out, *args)
    assert res.returncode == 0, res.stderr
    return json.loads((out / "report.json").read_text())


def test_synthetic_images_calibrate_a_vlm_in_memory_and_streamed_alike(tmp_path):
    model, image = tiny_llava(tmp_path / "src")
    rep = _quantize(tmp_path / "src", tmp_path / "mem", "--in-memory")
    _quantize(tmp_path / "src", tmp_path / "stream", "--stream")
    assert any(n.startswith("calibrated on 2 image-text pairs through LlavaProcessor: synthetic") for n in rep["notes"])
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    # the same batches from Python: the image tokens (16 per image) and the pixels are in them
    args = types.SimpleNamespace(calib=2, calib_images=None, seq_len=32)
    text = bridge.app.inputs.corpus_text("builtin", part="calibration")
    batches, _ = images.image_calibration(args, tmp_path / "src", model, None, text)
    assert all(int((b["input_ids"] == image).sum()) == 16 and b["pixel_values"].shape[-1] == 32 for b in batches)
    recipe = qt.get_preset("gptq4-g64").recipe
    want = bridge.quantize(model, recipe, calibration=batches)
    textual = bridge.quantize(model, recipe, calibration=[b["input_ids"][b["input_ids"] != image][None] for b in batches])
    got = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "mem").eval()
    with torch.no_grad():
        torch.testing.assert_close(got(IDS).logits, want(IDS).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(want(IDS).logits, textual(IDS).logits, atol=1e-4)  # the images told


def test_a_directory_with_captions_and_a_jsonl(tmp_path):
    tiny_llava(tmp_path / "src")
    pics = tmp_path / "pics"
    pics.mkdir()
    for i, img in enumerate(images.synthetic_images(2, size=40, seed=3)):
        img.save(pics / f"{i}.png")
    (pics / "0.txt").write_text("a red square")
    rep = _quantize(tmp_path / "src", tmp_path / "dir", "--in-memory", "--calib-images", pics)
    assert any(f"images of {pics}" in n for n in rep["notes"])
    (pics / "list.jsonl").write_text(json.dumps({"image": "0.png", "text": "one"}) + "\n{not json\n")
    res = main_cli("quantize", "--model", tmp_path / "src", "--recipe", "gptq4-g64", "--calib", "2", "--no-eval",
                   "--seq-len", "32", "--out", tmp_path / "bad", "--calib-images", pics / "list.jsonl", "--in-memory")
    one_line_error(res, "--calib-images", "list.jsonl line 2: not JSON")
    assert not (tmp_path / "bad").exists()


def test_a_text_model_refuses_calib_images_by_name(tmp_path):
    torch.manual_seed(0)
    tiny_lm.model().save_pretrained(tmp_path / "src")
    tiny_lm.tokenizer().save_pretrained(tmp_path / "src")
    res = main_cli("quantize", "--model", tmp_path / "src", "--recipe", "gptq4-g64", "--calib", "2", "--no-eval",
                   "--seq-len", "32", "--out", tmp_path / "out", "--calib-images", "synthetic")
    one_line_error(res, "--calib-images", "LlamaForCausalLM has no vision tower")


@pytest.mark.parametrize("real", [False, pytest.param(True, marks=pytest.mark.long)])
def test_smolvlm_shaped_weights_calibrated_on_images_reload_to_the_same_logits(real, tmp_path, monkeypatch):
    model, image, seq = smolvlm_shaped(tmp_path / "src", real=real)
    held = []
    on_command_model(monkeypatch, lambda qmodel: held.append(qmodel(IDS).logits))
    rep = _quantize(tmp_path / "src", tmp_path / "out", "--in-memory")
    assert any("calibrated on 2 image-text pairs through Idefics3Processor" in n for n in rep["notes"])
    got = transformers.Idefics3ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():  # the checkpoint reloads to the model the command held
        torch.testing.assert_close(got(IDS).logits, held[0], rtol=1e-4, atol=1e-4)
    args = types.SimpleNamespace(calib=2, calib_images=None, seq_len=32)
    text = bridge.app.inputs.corpus_text("builtin", part="calibration")
    batches, _ = images.image_calibration(args, tmp_path / "src", model, None, text)
    assert all(int((b["input_ids"] == image).sum()) == seq for b in batches)  # the image's tokens in every batch
