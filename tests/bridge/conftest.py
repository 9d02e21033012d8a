"""Fixtures of the bridge tests."""

import pytest
import torch

from bridge_util import ConvNet, EmbedNet


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a whole test module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    the block-by-block steps' results do not depend on it, their timings on a shared machine less."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
