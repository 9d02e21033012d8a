"""Fixtures of the bridge tests."""

import pytest
import torch

from bridge_util import ConvNet, EmbedNet


@pytest.fixture
def convnet():
    torch.manual_seed(0)
    return ConvNet().eval()


@pytest.fixture
def embednet():
    torch.manual_seed(0)
    return EmbedNet().eval()


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A tiny untrained Llama with SmolLM2's tokenizer, saved as a transformers directory."""
    from bridge_util import tiny_llama_with_tokenizer

    model, tokenizer = tiny_llama_with_tokenizer()
    d = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d
