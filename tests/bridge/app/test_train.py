"""``qtransform train`` from the command line on a tiny Llama with the tiny tokenizer: training lowers the loss, the
checkpoint loads in transformers and in ``bridge.load`` with the logits the command's quantized model computed,
``--ranges-only`` keeps every float weight and takes the codes of the start's weights under the trained ranges,
a run killed with SIGKILL resumes to the bytes of a run that never stopped, a resume whose inputs changed and bad
options are refused by name before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import qtransform as qt
from bridge.app.cli import main

from bridge_util import on_command_model
from stream_util import digests
import tiny_lm

COMMON = ("--seq-len", "16", "--batch", "4", "--threads", "1", "--eval-sequences", "2")

#: a plugin that kills the command (SIGKILL: no clean-up runs) when AdamW is about to take step KILL_AT + 1, or
#: with KILL_ON_WRITE when the trained model is about to be written
KILLER = '''
import os, signal, torch
at = int(os.environ["KILL_AT"])
taken = [0]
real_step = torch.optim.AdamW.step
def step(self, *args, **kwargs):
    taken[0] += 1
    if taken[0] > at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(self, *args, **kwargs)
torch.optim.AdamW.step = step
if os.environ.get("KILL_ON_WRITE"):  # once training is over, as the checkpoint is about to be written
    import bridge.io
    def writer(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    bridge.io.checkpoint_writer = writer
'''


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("train") / "src"
    tiny_lm.model().save_pretrained(d)
    tiny_lm.tokenizer().save_pretrained(d)
    return d


def _args(source, out, *extra, recipe="int4-g32"):
    return ["train", "--model", str(source), "--recipe", recipe, "--out", str(out), *COMMON, *extra]


def _train(source, out, *extra, recipe="int4-g32") -> dict:
    assert main(_args(source, out, *extra, recipe=recipe)) == 0
    return json.loads((out / "report.json").read_text())


def _mean(values):
    return sum(values) / len(values)


IDS = torch.tensor([[2, 5, 9, 3, 14, 7, 2, 30, 11, 4]])


def _reloads_with(out, logits) -> None:
    from transformers import AutoModelForCausalLM

    import bridge

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    back = bridge.load(out, like=tiny_lm.model())
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, logits)
        assert torch.equal(back(IDS).logits, logits)


def test_training_lowers_the_loss_and_the_checkpoint_reloads_with_the_commands_logits(source, tmp_path, monkeypatch):
    seen = {}
    on_command_model(monkeypatch, lambda q: seen.update(logits=q(IDS).logits.detach()))
    out = tmp_path / "out"
    rep = _train(source, out, "--tokens", "2500", "--lr", "1e-3", "--range-lr", "1e-3", "--plot")
    t = rep["training"]
    assert (t["steps"], t["tokens"], t["budget"], len(t["loss"])) == (40, 2560, 2500, 40)  # ceil(2500 / 64) steps
    assert _mean(t["loss"][-5:]) < _mean(t["loss"][:5])
    assert rep["ppl_after"] < rep["ppl_before"]
    assert {"prepare", "train", "convert", "write"} <= set(rep["phases"]) and rep["peak_memory"] > 0
    assert len(rep["layers"]) == 14 and (out / "report.png").is_file()
    assert not (tmp_path / ".out.train-state").exists()  # the output is whole: the state is spent
    _reloads_with(out, seen["logits"])


def test_the_cosine_schedule_with_warm_up_sets_every_steps_rates(source, tmp_path, monkeypatch):
    """6 steps, 2 of warm-up: each group's rate at step t is its base rate times (t + 1) / 2 during the warm-up,
    then (1 + cos(pi (t - 2) / 4)) / 2 (values written out here, not taken from the code)."""
    rates = []
    step = torch.optim.AdamW.step

    def recording(self, *args, **kwargs):
        rates.append([g["lr"] for g in self.param_groups])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording)
    rep = _train(source, tmp_path / "out", "--tokens", "384", "--lr", "1e-3", "--range-lr", "2e-3", "--no-eval",
                 "--schedule", "cosine", "--warmup", "2")
    factors = [0.5, 1.0, 1.0, 0.8535533905932737, 0.5, 0.14644660940672627]
    assert [r for pair in rates for r in pair] == pytest.approx([r for f in factors for r in (1e-3 * f, 2e-3 * f)],
                                                                rel=1e-12)
    assert (rep["training"]["schedule"], rep["training"]["warmup"]) == ("cosine", 2)


def test_ranges_only_keeps_every_float_weight_and_codes_the_start_under_the_trained_ranges(source, tmp_path):
    from safetensors.torch import load_file

    import bridge

    out = tmp_path / "out"
    rep = _train(source, out, "--tokens", "640", "--ranges-only", "--range-lr", "1e-2", "--no-eval",
                 recipe="int4-g32-asym")
    assert rep["training"]["ranges_only"] and rep["ppl_after"] is None
    start = load_file(str(source / "model.safetensors"))
    qtree = bridge.load_tree(out)
    assert set(qtree) == set(start)
    trained = 0
    for path, v in qtree.items():
        if isinstance(v, qt.QTensor):
            assert torch.equal(v.codes, qt.quantize(start[path], v.qparams).codes), path
            trained += not torch.equal(v.qparams.scale, qt.choose_qparams(start[path], v.spec).scale)
        else:
            assert torch.equal(v, start[path]), path
    assert trained == 14  # every range moved


def _killed(source, out, tmp_path, *extra, at: int, recipe="int4-g32", **env) -> None:
    """The command in a process of its own, killed with SIGKILL as AdamW is about to take step ``at`` + 1."""
    plugin = tmp_path / "killer.py"
    plugin.write_text(KILLER)
    cmd = [sys.executable, "-m", "bridge.app.cli", *_args(source, out, *extra, recipe=recipe), "--plugin", str(plugin)]
    run = subprocess.run(cmd, env={**os.environ, "KILL_AT": str(at), **env}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert not out.exists()


def test_killed_training_resumes_to_the_bytes_of_a_run_that_never_stopped(source, tmp_path, capsys):
    extra = ("--tokens", "1280", "--lr", "1e-3", "--range-lr", "1e-3", "--distill", "--temperature", "2",
             "--schedule", "cosine", "--warmup", "4", "--no-eval")  # killed within the cosine: the same rates
    whole = _train(source, tmp_path / "whole", *extra)
    out = tmp_path / "out"
    _killed(source, out, tmp_path, *extra, "--save-every", "3", at=7)
    state = tmp_path / ".out.train-state"
    assert json.loads((state / "state.json").read_text())["step"] == 6

    assert main(_args(source, out, *extra, "--resume", "--lr", "2e-3", "--seed", "1")) == 1  # changed: refused
    assert "with another --lr, --seed than this run" in capsys.readouterr().err
    assert json.loads((state / "state.json").read_text())["step"] == 6  # and left as it was

    rep = _train(source, out, *extra, "--resume", "--save-every", "5")  # how often it saves changes no byte
    assert digests(out) == digests(tmp_path / "whole")
    assert rep["training"]["loss"] == whole["training"]["loss"] and rep["training"]["resumed_at"] == 6
    assert not state.exists()

    # killed once training is over, as the checkpoint is being written: the resumed run trains no more
    _killed(source, tmp_path / "late", tmp_path, *extra, at=10**6, KILL_ON_WRITE="1")
    assert json.loads((tmp_path / ".late.train-state" / "state.json").read_text())["step"] == 20
    rep = _train(source, tmp_path / "late", *extra, "--resume")
    assert digests(tmp_path / "late") == digests(tmp_path / "whole") and rep["training"]["resumed_at"] == 20


def test_a_changed_resume_is_refused_naming_what_changed(source, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(tiny_lm.WORDS[i:] + tiny_lm.WORDS[:i]) for i in range(40)))
    out = tmp_path / "out"
    extra = ("--tokens", "192", "--no-eval", "--corpus", str(corpus))
    _killed(source, out, tmp_path, *extra, "--save-every", "1", at=1)
    other = tmp_path / "other"
    tiny_lm.model(seed=1).save_pretrained(other)
    tiny_lm.tokenizer().save_pretrained(other)
    capsys.readouterr()
    for changed, named in ((("--tokens", "256"), "--tokens"), (("--batch", "2"), "--batch"),
                           (("--range-lr", "1e-3"), "--range-lr"), (("--seed", "3"), "--seed"),
                           (("--distill",), "--distill"), (("--ranges-only",), "--ranges-only"),
                           (("--schedule", "cosine"), "--schedule"), (("--warmup", "1"), "--warmup"),
                           (("--recipe", "int4-g64"), "recipe"), (("--model", str(other)), "model"),
                           (("--corpus", "builtin"), "--corpus")):
        assert main([*_args(source, out, *extra, "--resume"), *changed]) == 1
        err = capsys.readouterr().err
        assert f"with another {named} than this run" in err and "run without --resume" in err, err
    corpus.write_text("a new start\n\n" + corpus.read_text())  # the same options, other data: refused once tokenized
    assert main(_args(source, out, *extra, "--resume")) == 1
    assert "with another data than this run" in capsys.readouterr().err
    assert json.loads((tmp_path / ".out.train-state" / "state.json").read_text())["step"] == 1


def _fail_loading(monkeypatch):
    from bridge.app import inputs

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(inputs, "model_and_tokenizer", refuse)


@pytest.mark.parametrize("extra, status, message", [
    (("--tokens", "0"), 2, "argument --tokens: must be at least 1 token"),
    (("--tokens", "-5"), 2, "argument --tokens: must be at least 1 token"),
    (("--tokens", "lots"), 2, "argument --tokens: expected a number of tokens"),
    (("--tokens", "64", "--lr", "0"), 2, "argument --lr: must be a finite number > 0"),
    (("--tokens", "64", "--bogus"), 2, "unrecognized arguments: --bogus"),
    (("--tokens", "64", "--temperature", "2"), 1, "--temperature goes with --distill"),
    (("--tokens", "64", "--warmup", "5"), 1, "--warmup: 5 steps leave none of the"),
    (("--tokens", "64", "--schedule", "linear"), 2, "argument --schedule: invalid choice"),
    (("--tokens", "64", "--resume"), 1, "--resume: there is no training state to resume"),
    (("--tokens", "64", "--ranges-only", "--recipe", "CAST"), 1, "--ranges-only: recipe"),
    (("--tokens", "64", "--recipe", "gptq4-g64"), 1, "recipe gptq4-g64: recipe.steps[0] (gptq)"),
])
def test_bad_input_is_refused_by_name_before_any_work(source, tmp_path, monkeypatch, capsys, extra, status, message):
    _fail_loading(monkeypatch)
    cast = tmp_path / "cast.json"
    cast.write_text(json.dumps({"type_rules": {"Linear": {"format": "bf16"}}, "exclude": ["lm_head*"]}))
    args = _args(source, tmp_path / "out", *[str(cast) if x == "CAST" else x for x in extra])
    if status == 2:
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
    else:
        assert main(args) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.train-state").exists()


def test_an_existing_output_is_refused_before_any_work(source, tmp_path, monkeypatch, capsys):
    _fail_loading(monkeypatch)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep")
    assert main(_args(source, tmp_path / "out", "--tokens", "64")) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "out" / "x").read_text() == "keep"


def test_block_wise_training_then_end_to_end(source, tmp_path, monkeypatch):
    """A recipe with the ``qat`` step (Block-AP) runs it first on ``--calib`` sequences, then trains end to end."""
    recipe = tmp_path / "qat.json"
    recipe.write_text(json.dumps({"type_rules": {"Linear": "qat2-g64"}, "exclude": ["lm_head*"],
                                  "steps": [{"name": "qat", "options": {"iters": 2, "batch_size": 2, "holdout": 0}}]}))
    seen = {}
    on_command_model(monkeypatch, lambda q: seen.update(logits=q(IDS).logits.detach()))
    out = tmp_path / "out"
    rep = _train(source, out, "--tokens", "320", "--calib", "4", "--lr", "1e-3", "--no-eval", recipe=str(recipe))
    assert rep["steps"] == [{"name": "qat", "options": {"iters": 2, "batch_size": 2, "holdout": 0}}]
    assert rep["calib_tokens"] == 64 and len(rep["training"]["loss"]) == 5
    _reloads_with(out, seen["logits"])
