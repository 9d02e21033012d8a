"""A model with two stacks of blocks (an encoder-decoder language model inside a vision-language model: Florence-2's
BART) is calibrated stack by stack in memory (the encoder's blocks, then the decoder's), and refused by name by the
streamed driver, which runs one stack of blocks (before anything is written)."""

import pytest
import torch

import bridge
import qtransform as qt
import tiny_lm
from bridge.calibrate.blocks import find_stacks
from bridge.stream import quantize_checkpoint
from bridge.stream.accept import CannotStream

from .tiny_any import ENTRIES, build, tokens

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")
GPTQ = qt.get_preset("gptq4-g64").recipe


@pytest.fixture(scope="module")
def florence():
    return build(ENTRIES["florence2"])


def test_both_stacks_are_found_encoder_first(florence):
    stacks = find_stacks(florence)
    assert [s[0] for s in stacks] == ["model.language_model.encoder.layers.0", "model.language_model.decoder.layers.0"]


def test_in_memory_gptq_fits_both_stacks(florence):
    batches = [tokens(florence, seed=s) for s in (2, 3)]
    got = bridge.extract(bridge.quantize(florence, GPTQ, calibration=batches, kernel="dequant"))
    rtn = bridge.extract(bridge.quantize(florence, qt.Recipe(type_rules=GPTQ.type_rules, exclude=GPTQ.exclude),
                                         kernel="dequant"))
    fitted = {p for p, v in got.items() if isinstance(v, qt.QTensor) and not torch.equal(v.codes, rtn[p].codes)}
    for stack in ("encoder", "decoder"):
        assert any(p.startswith(f"model.language_model.{stack}.layers.") for p in fitted), stack


def test_streamed_calibration_is_refused_by_name(florence, tmp_path):
    florence.save_pretrained(tmp_path / "src")
    tiny_lm.tokenizer().save_pretrained(tmp_path / "src")
    with pytest.raises(CannotStream, match="Florence2ForConditionalGeneration calibrates two stacks"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "out", GPTQ, calibration=[tokens(florence, seed=2)])
    assert not (tmp_path / "out").exists()
