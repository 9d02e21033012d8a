"""Encoder-decoder models from the command line (issue 51, part 4): T5 (no causal-LM class in transformers) is
refused by name by both drivers, before anything is written; Whisper loads as transformers' causal LM of its
decoder, which is quantized, while its encoder is carried into the checkpoint as stored and said so; the
checkpoint reloads to the logits of the model the command held, and the whole model loads with the encoder."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

import tiny_lm
from bridge_util import on_command_model
from cli_util import main_cli, one_line_error
from tiny_vlm import build_tiny

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
IDS = torch.randint(0, 200, (1, 10), generator=torch.Generator().manual_seed(0))


def _save(model_type, cls, directory):
    model = build_tiny(model_type, model_class=cls)
    model.save_pretrained(directory)
    tiny_lm.tokenizer().save_pretrained(directory)
    return model


@pytest.mark.parametrize("driver", ["--in-memory", "--stream"])
def test_t5_is_refused_by_name(driver, tmp_path):
    _save("t5", transformers.T5ForConditionalGeneration, tmp_path / "src")
    res = main_cli("quantize", "--model", tmp_path / "src", "--recipe", "int4-g32", "--no-eval", "--out",
                   tmp_path / "out", driver)
    one_line_error(res, "T5ForConditionalGeneration (model type 't5') is an encoder-decoder model")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("driver", ["--in-memory", "--stream"])
def test_whisper_decoder_quantized_encoder_carried(driver, tmp_path, monkeypatch):
    _save("whisper", transformers.WhisperForConditionalGeneration, tmp_path / "src")
    held = []
    on_command_model(monkeypatch, lambda q: held.append(q(IDS).logits))
    res = main_cli("quantize", "--model", tmp_path / "src", "--recipe", "int4-g32", "--no-eval", "--out",
                   tmp_path / "out", driver)
    assert res.returncode == 0, res.stderr
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    quantized = set(cfg["quantization_config"]["tensors"])
    assert quantized and all(p.startswith(("model.decoder.", "proj_out")) for p in quantized)
    carried = cfg["quantization_config"]["carried"]
    stored, written = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    encoder = sorted(n for n in stored if n.startswith("model.encoder."))
    assert encoder and carried == encoder
    assert all(torch.equal(written[n], stored[n]) for n in encoder)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any(f"kept as stored: {len(encoder)} tensor(s)" in n and "model.encoder" in n for n in report["notes"])
    decoder = transformers.WhisperForCausalLM.from_pretrained(tmp_path / "out").eval()
    whole = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        if held:  # in memory: the model the command held
            torch.testing.assert_close(decoder(IDS).logits, held[0], rtol=1e-4, atol=1e-4)
        for n in encoder[:5]:
            assert torch.equal(whole.get_parameter(n), stored[n])
