"""``qtransform eval --tasks``: lm-evaluation-harness on our loaded model, on tasks defined on local files.

The model is a tiny Llama quantized to int4 and saved by ``bridge.save`` with a word-level tokenizer (one
token per word, so the harness and this file split every text into the same tokens). The expected values
are computed here from the reloaded checkpoint's logits, by our own scoring: the log-likelihood of each
choice after its question, and of each text after the end-of-sequence token.
"""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")  # the `eval` extra; `make test` installs it (pyproject's test extra)

import qtransform as qt  # noqa: E402
import tiny_lm  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

REPO = Path(__file__).resolve().parents[3]
# Questions and their three choices, all words of the tiny vocabulary (no unknown token).
QUESTIONS = [("the value of", ["one", "two", "list"]), ("this function has", ["a", "data", "name"]),
             ("we return the", ["string", "file", "class"]), ("it is not", ["the", "that", "which"]),
             ("they had an", ["object", "module", "type"]), ("she was in", ["her", "his", "their"]),
             ("this list of", ["data", "value", "one"]), ("you have a", ["name", "file", "string"])]
TEXTS = ["the function returns a list of data", "this module has one class and two functions",
         "we have the name of the file"]


def run(*args, cache):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(cache),
               TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)


def _choice_logliks(model, tok, question, choices):
    """log p(" choice" | question) for each choice: one forward pass over question + choice."""
    ctx = tok(question)["input_ids"]
    out = []
    for c in choices:
        cont = tok(" " + c)["input_ids"]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
        out.append(sum(float(logp[len(ctx) + i - 1, t]) for i, t in enumerate(cont)))
    return out


def _text_loglik(model, tok, text):
    """log p(text | end-of-sequence token): every token of the text scored."""
    ids = [tok.eos_token_id] + tok(text)["input_ids"]
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return sum(float(logp[i - 1, t]) for i, t in enumerate(ids) if i > 0)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """An int4 checkpoint, its scores computed here, and two harness tasks on JSONL files: a multiple
    choice task whose labels are the model's own choice on even documents and another choice on odd
    ones (accuracy 1/2), and a rolling log-likelihood task (word perplexity)."""
    from transformers import AutoModelForCausalLM

    import bridge

    root = tmp_path_factory.mktemp("lmeval")
    tok = tiny_lm.tokenizer()
    model = bridge.quantize(tiny_lm.model(seed=3), qt.presets()["int4-g32"].recipe)
    bridge.save(model, root / "ckpt", tokenizer=tok)
    back = AutoModelForCausalLM.from_pretrained(root / "ckpt").eval()
    assert isinstance(back.model.layers[0].mlp.up_proj, bridge.QLinear)

    scores = [_choice_logliks(back, tok, q, c) for q, c in QUESTIONS]
    best = [max(range(3), key=s.__getitem__) for s in scores]
    margin = min(sorted(s)[-1] - sorted(s)[-2] for s in scores)
    assert margin > 1e-2, margin  # no near-tie that another kernel's float rounding could flip
    labels = [b if i % 2 == 0 else (b + 1) % 3 for i, b in enumerate(best)]
    rows = [{"question": q, "choices": c, "label": lab} for (q, c), lab in zip(QUESTIONS, labels)]
    (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tasks = root / "tasks"
    tasks.mkdir()
    # the multiple-choice task is docs/command.md's example
    doc = re.search(r"```yaml\n(.*?)```", (REPO / "docs" / "command.md").read_text(), re.S).group(1)
    assert "task: my_mc" in doc and "/path/to/questions.jsonl" in doc
    (tasks / "tiny_mc.yaml").write_text(textwrap.dedent(doc).replace("my_mc", "tiny_mc")
                                        .replace("/path/to/questions.jsonl", str(root / "mc.jsonl")))
    (tasks / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'texts.jsonl'}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")
    lls = [_text_loglik(back, tok, t) for t in TEXTS]
    word_ppl = math.exp(-sum(lls) / sum(len(t.split()) for t in TEXTS))
    return {"root": root, "ckpt": root / "ckpt", "tasks": tasks, "scores": scores, "labels": labels,
            "word_ppl": word_ppl, "model": back, "tok": tok}


def test_the_command_scores_local_tasks_as_our_own_log_likelihoods(local):
    out = local["root"] / "eval.json"
    res = run("-m", "bridge.app.cli", "eval", "--model", str(local["ckpt"]), "--tasks", "tiny_mc,tiny_ppl",
              "--include-path", str(local["tasks"]), "--batch-size", "3", "--json", str(out), cache=local["root"] / "datasets")
    assert res.returncode == 0, res.stderr
    assert "tiny_mc" in res.stdout and "word_perplexity" in res.stdout
    rep = json.loads(out.read_text())
    assert rep["tasks"] == ["tiny_mc", "tiny_ppl"] and [r["role"] for r in rep["results"]] == ["model"]
    got = rep["results"][0]
    assert got["n-samples"]["tiny_mc"]["effective"] == len(QUESTIONS)
    assert got["results"]["tiny_mc"]["acc,none"] == 0.5  # the labels agree with our scores on every other doc
    assert got["results"]["tiny_ppl"]["word_perplexity,none"] == pytest.approx(local["word_ppl"], rel=1e-5)


def test_limit_evaluates_the_first_documents_with_our_log_likelihoods(local, monkeypatch, tmp_path):
    import datasets

    from bridge.app import lmeval

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    model, tok = local["model"], local["tok"]
    model.train()  # the harness runs it in eval mode and gives it back as it was
    r = lmeval.evaluate(model, tok, str(local["tasks"] / "tiny_mc.yaml"), limit=3, batch_size=2,  # a task file
                        log_samples=True)
    assert model.training
    model.eval()
    assert r["n-samples"]["tiny_mc"] == {"original": len(QUESTIONS), "effective": 3}
    assert r["results"]["tiny_mc"]["acc,none"] == pytest.approx(2 / 3)  # docs 0 and 2 right, 1 wrong
    samples = sorted(r["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == [0, 1, 2]
    for s in samples:
        harness = [resp[0][0] for resp in s["resps"]]
        assert harness == pytest.approx(local["scores"][s["doc_id"]], abs=1e-4)
    rows = lmeval.metric_rows([("model", r)])
    assert rows[0] == ["task", "docs", "metric", "model"] and rows[1][:3] == ["tiny_mc", "3", "acc"]


def test_bad_task_names_limits_and_a_missing_harness_are_one_line_errors(local, capsys, monkeypatch):
    from bridge.app import cli, lmeval

    base = ["eval", "--model", str(local["ckpt"]), "--include-path", str(local["tasks"])]
    assert cli.main(base + ["--tasks", "tiny_mc,no_such_task"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("qtransform: error: --tasks: unknown task 'no_such_task'") and "\n" not in err
    assert "tiny_mc'" not in err and "--include-path" in err
    assert cli.main(base + ["--tasks", "tiny_mc,"]) == 1
    assert "--tasks: expected NAME[,NAME...]" in capsys.readouterr().err
    assert cli.main(["eval", "--model", str(local["ckpt"]), "--tasks", "tiny_mc", "--include-path",
                     str(local["root"] / "nowhere")]) == 1
    assert "--include-path: " in capsys.readouterr().err
    for bad in ("0", "-2", "x"):
        with pytest.raises(SystemExit) as e:
            cli.main(base + ["--tasks", "tiny_mc", "--limit", bad])
        assert e.value.code == 2 and "argument --limit" in capsys.readouterr().err
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="limit must be an integer >= 1"):
            lmeval.evaluate(local["model"], local["tok"], ["tiny_mc"], include_path=local["tasks"], limit=bad)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    assert cli.main(base + ["--tasks", "tiny_mc"]) == 1
    err = capsys.readouterr().err.strip()
    assert "needs lm-evaluation-harness" in err and "(lm_eval[hf])" in err and "pip install 'qtransform[eval]'" in err and "\n" not in err


def _plain_lm_eval(local, tmp_path, target):
    """The README's plain ``lm_eval --model hf --model_args pretrained=DIR`` on our checkpoint exported to
    ``target``, in a process that never imports ``bridge``: our accuracy, and our log-likelihoods to within
    the rounding of transformers' dequantized weights."""
    import bridge.interop

    out = bridge.interop.export(local["ckpt"], to=target, out=tmp_path / target)
    argv = ["lm_eval", "--model", "hf", "--model_args", f"pretrained={out},dtype=float32", "--tasks", "tiny_mc",
            "--include_path", str(local["tasks"]), "--device", "cpu", "--batch_size", "4", "--limit", "5",
            "--log_samples", "--output_path", str(tmp_path / "out")]
    res = run("-c", f"import sys\nfrom lm_eval.__main__ import cli_evaluate\nsys.argv = {argv!r}\ncli_evaluate()\n"
              "assert not [m for m in sys.modules if m.split('.')[0] in ('bridge', 'qtransform')], 'ours imported'",
              cache=tmp_path / "datasets")
    assert res.returncode == 0, res.stderr[-3000:]
    [results] = (tmp_path / "out").rglob("results_*.json")
    got = json.loads(results.read_text())
    assert got["n-samples"]["tiny_mc"]["effective"] == 5
    assert got["results"]["tiny_mc"]["acc,none"] == pytest.approx(3 / 5)  # docs 0, 2, 4 right
    [samples] = (tmp_path / "out").rglob("samples_tiny_mc_*.jsonl")
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        harness = [float(resp[0][0]) for resp in s["resps"]]  # transformers' dequantized weights, not
        assert harness == pytest.approx(local["scores"][s["doc_id"]], abs=1e-3)  # our kernel (1.3e-4 seen)


def test_lm_eval_command_line_on_a_compressed_tensors_export_gives_our_scores(local, tmp_path):
    _plain_lm_eval(local, tmp_path, "compressed-tensors")


@pytest.mark.long  # amd-quark's load through transformers: about 30 s of CPU
def test_lm_eval_command_line_on_a_quark_export_gives_our_scores(local, tmp_path):
    _plain_lm_eval(local, tmp_path, "quark")
