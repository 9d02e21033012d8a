"""bridge.evaluate: perplexity against hand-computed values, greedy generation against a manual loop."""

from __future__ import annotations

import sys
from pathlib import Path

import math

import pytest
import torch

from bridge.app import evaluate

sys.path.insert(0, str(Path(__file__).parent))  # the helper next to this file (any import mode)
import tiny_lm  # noqa: E402


class _Uniform(torch.nn.Module):
    """Predicts every token with probability 1/vocab: perplexity is exactly the vocabulary size."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        class Out:
            logits = torch.zeros(*input_ids.shape, self.vocab)
        return Out()


def test_uniform_model_has_perplexity_vocab_size():
    r = evaluate.perplexity(_Uniform(50), torch.randint(0, 50, (5, 9)), batch_size=2)
    assert r.tokens == 5 * 8 and math.isclose(r.perplexity, 50.0, rel_tol=1e-6)
    assert math.isclose(r.nll, math.log(50.0), rel_tol=1e-6)


def test_perplexity_matches_manual_log_likelihood():
    model = tiny_lm.model()
    seqs = torch.randint(0, model.config.vocab_size, (5, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=seqs).logits[:, :-1], -1)
    nll = -logp.gather(-1, seqs[:, 1:, None]).mean()
    model.train()
    r = evaluate.perplexity(model, seqs, batch_size=2)
    assert model.training  # mode restored
    assert math.isclose(r.nll, float(nll), rel_tol=1e-5)
    assert math.isclose(r.perplexity, math.exp(float(nll)), rel_tol=1e-5)
    assert math.isclose(evaluate.perplexity(model, seqs, batch_size=5).nll, r.nll, rel_tol=1e-5)


@pytest.mark.parametrize("seqs,match", [
    (torch.zeros(3, 8), "int64 tensor"), (torch.zeros(8, dtype=torch.int64), "int64 tensor"),
    (torch.zeros(3, 1, dtype=torch.int64), "2\\+ tokens"), ([[1, 2]], "int64 tensor"),
])
def test_perplexity_bad_input(seqs, match):
    with pytest.raises(ValueError, match=match):
        evaluate.perplexity(_Uniform(4), seqs)


def test_perplexity_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        evaluate.perplexity(_Uniform(4), torch.zeros(2, 4, dtype=torch.int64), batch_size=0)


def test_generate_is_greedy():
    model, tok = tiny_lm.model(seed=3), tiny_lm.tokenizer()
    prompt = "the value of the function is"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(6):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    assert evaluate.generate(model, tok, prompt, max_new_tokens=6) == tok.decode(new, skip_special_tokens=True)


def test_generate_bad_input():
    model, tok = tiny_lm.model(), tiny_lm.tokenizer()
    with pytest.raises(ValueError, match="prompt"):
        evaluate.generate(model, tok, "")
    with pytest.raises(ValueError, match="max_new_tokens"):
        evaluate.generate(model, tok, "the", max_new_tokens=0)
