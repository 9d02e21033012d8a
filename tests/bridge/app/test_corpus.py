"""bridge.corpus: the built-in docstring corpus, local files, datasets, token windows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from bridge.app import corpus

sys.path.insert(0, str(Path(__file__).parent))  # the helper next to this file (any import mode)
from tiny_lm import tokenizer  # noqa: E402


def test_builtin_is_deterministic_and_parts_do_not_overlap():
    ev, cal = corpus.builtin_documents("eval"), corpus.builtin_documents("calibration")
    assert ev == corpus.builtin_documents("eval") and cal == corpus.builtin_documents("calibration")
    assert len(ev) > 100 and len(cal) > 300
    assert len(set(ev)) == len(ev) and not set(ev) & set(cal)
    assert not set(corpus.EVAL_MODULES) & set(corpus.CALIBRATION_MODULES)
    cal_text = corpus.load_text("builtin", part="calibration")
    assert not any(d in cal_text for d in ev if len(d) > 200)  # no evaluation text leaks in
    assert corpus.load_text() == "\n\n".join(ev)


def test_builtin_documents_are_docstrings():
    import argparse
    import inspect

    ev = corpus.builtin_documents("eval")
    assert inspect.cleandoc(argparse.__doc__) == ev[0]
    assert inspect.cleandoc(argparse.ArgumentParser.__doc__) in ev


def test_local_file(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("first paragraph\n\nsecond one", encoding="utf-8")
    assert corpus.load_text(str(p)) == corpus.load_text(p) == "first paragraph\n\nsecond one"
    with pytest.raises(corpus.CorpusError, match="corpus not found: 'nope.txt'"):
        corpus.load_text("nope.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(corpus.CorpusError, match="is empty"):
        corpus.load_text(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(corpus.CorpusError, match="cannot read corpus file"):
        corpus.load_text(tmp_path / "bin.txt")
    with pytest.raises(corpus.CorpusError, match="cannot read corpus file"):
        corpus.load_text(tmp_path)  # a directory


def test_bad_arguments():
    with pytest.raises(ValueError, match="part must be one of"):
        corpus.load_text("builtin", part="test")
    with pytest.raises(TypeError, match="corpus source must be"):
        corpus.load_text(3)
    with pytest.raises(corpus.CorpusError, match="bad dataset name"):
        corpus.load_text("hf:")


def test_unreachable_dataset_is_one_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # datasets reads the variable once, at its import (here, or earlier in this process): without this it
    # tries the network, five retries with backoff (23 s), before the same ConnectionError
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(corpus.CorpusError, match=r"cannot load dataset hf:no-such-org/no-such-set .*split test"):
        corpus.load_text("hf:no-such-org/no-such-set")


def test_missing_datasets_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(corpus.CorpusError, match="pip install datasets"):
        corpus.load_text("hf:wikitext/wikitext-2-raw-v1")


def test_token_sequences_are_consecutive_windows():
    tok = tokenizer()
    text = corpus.load_text("builtin")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    seqs = corpus.token_sequences(text, tok, seq_len=64)
    assert seqs.dtype == torch.int64 and seqs.shape == (len(ids) // 64, 64)
    assert seqs.flatten().tolist() == ids[: seqs.numel()]
    few = corpus.token_sequences(text, tok, seq_len=64, max_sequences=3)
    assert torch.equal(few, seqs[:3])


def test_token_sequences_bad_input():
    tok = tokenizer()
    with pytest.raises(corpus.CorpusError, match="fewer than one sequence of 64"):
        corpus.token_sequences("the a of", tok, seq_len=64)
    with pytest.raises(ValueError, match="seq_len must be an int >= 2"):
        corpus.token_sequences("the a of", tok, seq_len=1)
    with pytest.raises(ValueError, match="max_sequences"):
        corpus.token_sequences("the a of", tok, seq_len=2, max_sequences=0)
    with pytest.raises(corpus.CorpusError, match="no text"):
        corpus.token_sequences("", tok)


def test_a_file_of_nul_and_control_bytes_is_refused_with_the_fraction(tmp_path):
    import random

    rng = random.Random(0)
    f = tmp_path / "binary.txt"
    f.write_bytes(bytes(rng.choice([0, 1, 2, 7, 27, 31]) if i % 4 else 97 for i in range(4000)))  # 75 % control
    with pytest.raises(corpus.CorpusError, match=r"binary.txt is not text: 75\.0% of its 4000 characters are NUL"):
        corpus.load_text(str(f))
    ok = tmp_path / "text.txt"
    ok.write_text("a line\twith a tab\r\nand a form feed\f" * 20 + "\x00")  # a stray NUL is text still
    assert corpus.load_text(str(ok)).startswith("a line")
    assert corpus.control_fraction("\x00\x1b ab") == 0.4


def test_the_command_refuses_a_binary_corpus(tmp_path, capsys):
    import tiny_lm
    from bridge.app.cli import main

    tiny_lm.model().save_pretrained(tmp_path / "m")
    tiny_lm.tokenizer().save_pretrained(tmp_path / "m")
    f = tmp_path / "noise.txt"
    f.write_bytes(b"\x00\x01\x02\x03 " * 500)
    for args in (["eval"], ["quantize", "--calib", "1", "--out", str(tmp_path / "o")]):
        rc = main([*args, "--model", str(tmp_path / "m"), "--corpus", str(f)])
        err = capsys.readouterr().err
        assert rc == 1 and "Traceback" not in err, err
        assert "noise.txt is not text: 80.0% of its 2500 characters" in err, err
    assert not (tmp_path / "o").exists()
