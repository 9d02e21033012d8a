"""Encoder-decoder models from the command line (issue 51, part 4): the command quantizes causal LMs and
vision-language models; an encoder-decoder checkpoint (T5, with no causal-LM class in transformers; Whisper and
BART, whose causal-LM class is their decoder alone, which would leave the encoder out) is refused by name by both
drivers, before anything is written, pointing to the Python API, which quantizes and calibrates both stacks
(``tests/bridge/walk/test_every_seq2seq_type.py``)."""

import pytest
import transformers

import tiny_lm
from cli_util import main_cli, one_line_error
from tiny_vlm import build_tiny

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
MODELS = {"t5": transformers.T5ForConditionalGeneration, "whisper": transformers.WhisperForConditionalGeneration,
          "bart": transformers.BartForConditionalGeneration}


@pytest.mark.parametrize("model_type", list(MODELS))
@pytest.mark.parametrize("driver", ["--in-memory", "--stream"])
def test_an_encoder_decoder_checkpoint_is_refused_by_name(model_type, driver, tmp_path):
    model = build_tiny(model_type, model_class=MODELS[model_type])
    model.save_pretrained(tmp_path / "src")
    tiny_lm.tokenizer().save_pretrained(tmp_path / "src")
    res = main_cli("quantize", "--model", tmp_path / "src", "--recipe", "int4-g32", "--no-eval", "--out",
                   tmp_path / "out", driver)
    line = one_line_error(res, f"{MODELS[model_type].__name__} (model type '{model_type}') is an encoder-decoder model")
    assert "bridge.quantize" in line
    assert not (tmp_path / "out").exists()
