"""The ``qtransform`` command with a rotation preset: the online rotations in the report, in ``inspect`` and in
the checkpoint that transformers loads. Through ``main(argv)`` (:mod:`cli_util`)."""

import json

import pytest
import torch

from cli_util import main_cli as cli

# Third-party warnings only, by category and module (ours, from bridge.* and qtransform.*, stay visible):
# TorchScript's deprecation, raised when transformers is first imported (`-W default -rw` shows no other).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")


def test_rotation_presets_report_save_and_reload_their_online_rotations(tiny_llama_dir, tmp_path):
    """A rotation preset (SpinQuant, W4A4) from the command line with a calibrated fp8 key cache: the report lists the online
    rotations (a Hadamard of the MLP width before each down projection, one of the head width on queries
    and keys) and what the step did, `inspect` lists them from the checkpoint, and from_pretrained gives
    the logits the command's own `eval` measures for the checkpoint."""
    out = tmp_path / "ckpt"
    res = cli("quantize", "--model", str(tiny_llama_dir), "--recipe", "spinquant-w4a4", "--out", str(out), "--calib", "4",
              "--seq-len", "32", "--eval-sequences", "2", "--kv-cache", "fp8_e4m3")
    assert res.returncode == 0, res.stderr
    rep = json.loads((out / "report.json").read_text())
    rows = sorted((r["module"], r["role"], r["size"]) for r in rep["online"])
    assert rows == sorted([(f"model.layers.{i}.mlp.down_proj", "input", 128) for i in range(2)]
                          + [(f"model.layers.{i}.self_attn", "key", 16) for i in range(2)])
    assert "online rotations: 2 input hadamard 128; 2 query/key hadamard 16" in res.stdout
    info = rep["step_info"]["model.layers.0.mlp.down_proj.weight"]
    assert info["rotation"] == "SpinQuant (r1, r2 learned, 100 iterations, weights float)"  # GPTQ follows
    before, _, kept = info["spinquant_loss"].partition(" -> ")  # (the loss falls: test_spinquant)
    assert 0 < float(kept.split()[0]) <= float(before)
    res = cli("inspect", str(out))
    assert res.returncode == 0 and "online rotations: 2 input hadamard 128; 2 query/key hadamard 16" in res.stdout
    assert "metadata version 4" in res.stdout

    from transformers import AutoModelForCausalLM

    from bridge.app import corpus, evaluate, models
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    seqs = corpus.token_sequences(corpus.load_text("builtin", part="eval"), models.load_tokenizer(str(tiny_llama_dir)),
                                  seq_len=32, max_sequences=2)
    with torch.no_grad():
        assert evaluate.perplexity(model, seqs).perplexity == pytest.approx(rep["ppl_after"], rel=1e-5)
