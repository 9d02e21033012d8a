"""Checkpoints written by qtransform 0.1.0 (metadata version 1) keep loading with identical logits.

The fixtures in tests/fixtures/v1 were written by main@20f39f2, before the metadata moved to
version 2: round to nearest and HQQ, every format family, GPT-2's Conv1D with calibration
choices (mse and percentile observers) stored in the specs, tied embeddings written by
``save_pretrained``. Each ``<name>.expected.safetensors`` holds input ids and the logits of the
in-memory quantized model that wrote it.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import bridge

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "v1"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


def test_fixtures_present():
    assert NAMES == ["gpt2-observers", "llama-formats", "llama-hqq4-g64", "llama-int4-g32",
                     "llama-tied-save-pretrained"]


@pytest.mark.parametrize("name", NAMES)
def test_from_pretrained_same_logits(name):
    expected = load_file(str(FIXTURES / f"{name}.expected.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name).eval()
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    assert torch.equal(logits, expected["logits"])


@pytest.mark.parametrize("name", [n for n in NAMES if n != "llama-tied-save-pretrained"])
def test_bridge_load_same_logits(name):
    expected = load_file(str(FIXTURES / f"{name}.expected.safetensors"))
    cfg = AutoConfig.from_pretrained(FIXTURES / name)
    cfg.quantization_config = None
    like = AutoModelForCausalLM.from_config(cfg).eval()
    model = bridge.load(FIXTURES / name, like=like).eval()
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    assert torch.equal(logits, expected["logits"])
