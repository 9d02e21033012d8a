"""``qtransform quantize`` chooses its driver: a checkpoint directory streams without any flag, what streaming
refuses runs in memory with the reason in the report, ``--stream`` insists, and a run whose estimated peak
exceeds the memory available is refused before anything is loaded or written."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

import tiny_lm
from bridge.app.cli import main
from bridge.stream import sizing


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("driver") / "tiny"
    tiny_lm.model(seed=3).to(torch.bfloat16).save_pretrained(d)
    tiny_lm.tokenizer().save_pretrained(d)
    return d


def _run(model_dir, out, *extra):
    return main(["quantize", "--model", str(model_dir), "--out", str(out), "--threads", "1", "--seq-len", "16",
                 "--eval-sequences", "2", *extra])


def _report(out):
    return json.loads((out / "report.json").read_text())


def _stored_bytes(directory):
    """Bytes of every tensor the safetensors files hold, read from their headers (independently of the code)."""
    total = 0
    for f in directory.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                total += t.numel() * t.element_size()
    return total


def test_a_checkpoint_directory_streams_by_default_and_measures_both_perplexities(bf16_dir, tmp_path, capsys):
    assert _run(bf16_dir, tmp_path / "auto", "--recipe", "int4-g32") == 0
    rep = _report(tmp_path / "auto")
    assert rep["streamed"] == "shard to shard"
    assert rep["driver"] == "streamed shard to shard (the default for a checkpoint directory)"
    assert "driver: streamed shard to shard" in capsys.readouterr().out
    # the original's perplexity is measured as in memory (the float model fits), on the same tokens
    assert _run(bf16_dir, tmp_path / "mem", "--recipe", "int4-g32", "--in-memory") == 0
    mem = _report(tmp_path / "mem")
    assert mem["streamed"] == "" and mem["driver"] == "in memory (--in-memory)"
    assert rep["ppl_before"] == pytest.approx(mem["ppl_before"], rel=1e-6) and rep["ppl_after"] > 0
    assert rep["layers"] and all(r["rel_error"] is not None for r in rep["layers"])  # measured by default
    # the size before is the stored one: bf16, 16 bits a weight, in both drivers
    assert rep["size_before"] == mem["size_before"] == _stored_bytes(bf16_dir)
    assert rep["bits_per_weight_before"] == mem["bits_per_weight_before"] == 16


def test_what_streaming_refuses_runs_in_memory_with_the_reason(bf16_dir, tmp_path):
    assert _run(bf16_dir, tmp_path / "q", "--recipe", "int4-g32", "--lowrank", "2", "--no-eval") == 0
    rep = _report(tmp_path / "q")
    assert rep["streamed"] == "" and rep["lowrank"]
    assert rep["driver"].startswith("in memory (recipe.steps[0] (lowrank): low-rank corrections are not written")


def test_stream_insists_and_says_why_it_cannot(bf16_dir, tmp_path, capsys):
    assert _run(bf16_dir, tmp_path / "q", "--recipe", "int4-g32", "--lowrank", "2", "--no-eval", "--stream") == 1
    err = capsys.readouterr().err
    assert "--stream:" in err and "cannot be streamed" in err and "lowrank" in err
    assert not (tmp_path / "q").exists()


def test_streaming_options_in_memory_are_refused_by_name(bf16_dir, tmp_path, capsys):
    assert _run(bf16_dir, tmp_path / "q", "--recipe", "int4-g32", "--in-memory", "--resume") == 1
    assert "--resume go with a streamed run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        _run(bf16_dir, tmp_path / "q", "--stream", "--in-memory")
    assert e.value.code == 2


@pytest.mark.parametrize("driver", [(), ("--in-memory",)], ids=["streamed", "in-memory"])
def test_a_run_that_cannot_fit_is_refused_with_its_estimate(bf16_dir, tmp_path, capsys, monkeypatch, driver):
    monkeypatch.setattr(sizing, "available", lambda: 10_000_000)  # 10 MB: less than the process alone
    assert _run(bf16_dir, tmp_path / "q", "--recipe", "gptq4-g64", "--calib", "2", *driver) == 1
    err = capsys.readouterr().err
    assert "needs about" in err and "10 MB available" in err and "--no-memory-check" in err
    assert ("streamed block by block" if not driver else "in memory (--in-memory)") in err
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q*"))  # nothing written
    assert _run(bf16_dir, tmp_path / "q", "--recipe", "gptq4-g64", "--calib", "2", "--no-eval", "--no-memory-check",
                *driver) == 0


def test_the_original_is_not_evaluated_when_it_does_not_fit(bf16_dir, tmp_path, monkeypatch):
    from bridge.app import driver

    real = driver.choose_driver

    def tight(*args, **kwargs):  # the run fits, loading the float model whole would not
        return real(*args, **kwargs)._replace(eval_before=False, available=123_000_000)

    monkeypatch.setattr(driver, "choose_driver", tight)
    assert _run(bf16_dir, tmp_path / "q", "--recipe", "int4-g32") == 0
    rep = _report(tmp_path / "q")
    assert rep["ppl_before"] is None and rep["ppl_after"] > 0
    assert rep["notes"] == ["perplexity of the original not measured: the float model loaded whole does not fit the "
                            "123 MB available (`qtransform eval --model` measures it elsewhere)"]


@pytest.mark.parametrize("driver", [(), ("--in-memory",)], ids=["streamed", "in-memory"])
def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_any_work(tmp_path, capsys, driver):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path / "small-vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(d)
    tiny_lm.tokenizer().save_pretrained(d)  # ids up to len(WORDS) + 1
    assert _run(d, tmp_path / "q", "--recipe", "int4-g32", *driver) == 1
    err = capsys.readouterr().err
    found = re.search(r"token id (\d+) in the evaluation text, but the model's embedding has 8 rows", err)
    assert found and 8 <= int(found[1]) <= len(tiny_lm.WORDS) + 1
    assert "IndexError" not in err and not (tmp_path / "q").exists()


def test_the_checkpoint_is_not_evaluated_when_loading_it_does_not_fit(bf16_dir, tmp_path, monkeypatch):
    from bridge.app import driver

    real = driver.choose_driver
    monkeypatch.setattr(driver, "choose_driver", lambda *a, **k: real(*a, **k)._replace(eval_after=False))
    assert _run(bf16_dir, tmp_path / "q", "--recipe", "int4-g32") == 0
    rep = _report(tmp_path / "q")
    assert rep["ppl_before"] > 0 and rep["ppl_after"] is None
    assert rep["notes"][0].startswith("perplexity of the quantized checkpoint not measured: loading it whole does not "
                                      "fit the ")
