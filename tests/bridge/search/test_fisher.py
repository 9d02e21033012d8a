"""The Fisher diagonal of the model's output with respect to a layer's outputs (bridge.search.output_fisher), against
its definition computed another way: for the last block's down_proj (whose output reaches the logits of its own
position only), the expected Fisher ``diag(Jᵀ (diag p - p pᵀ) J)`` per position from the Jacobian ``J`` of the logits
(torch.func.jacrev), which the drawn-token estimate must approach; for the head itself, ``E Σ_j F_j = Σ p (1 - p)``."""

import sys
from pathlib import Path

import pytest
import torch

from bridge.search import fisher_batches, fisher_pass, output_fisher

sys.path.insert(0, str(Path(__file__).parents[1]))
from bridge_util import tiny_causal_lm  # noqa: E402

DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def peaky():
    """A tiny Llama whose next-token distributions are far from uniform (head scaled up), and 2048 positions."""
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    g = torch.Generator().manual_seed(1)
    return model, [torch.randint(0, 128, (8, 32), generator=g) for _ in range(8)]


def _expected_down_proj_fisher(model, batches):
    """Mean over positions of diag(Jᵀ (diag p - p pᵀ) J), J = d logits_t / d (down_proj output)_t."""
    block = model.model.layers[1]
    total, count = torch.zeros(64, dtype=torch.float64), 0
    for b in batches:
        outs = {}
        handle = block.mlp.down_proj.register_forward_hook(lambda m, a, o: outs.setdefault("y", o.detach()))
        with torch.no_grad():
            model(b, use_cache=False)
        handle.remove()
        # the residual stream before the MLP's output is added: the block's output minus the MLP output
        hidden = {}
        h2 = block.register_forward_hook(lambda m, a, o: hidden.setdefault("h", (o[0] if isinstance(o, tuple) else o).detach()))
        with torch.no_grad():
            model(b, use_cache=False)
        h2.remove()
        residual = hidden["h"] - outs["y"]

        def logits_of(y, r):  # one position: final norm and head of (residual + down_proj output)
            return model.lm_head(model.model.norm(r + y))

        for y_row, r_row in zip(outs["y"].flatten(0, 1), residual.flatten(0, 1)):
            j = torch.func.jacrev(logits_of)(y_row, r_row).double()  # (vocab, hidden)
            p = torch.softmax(logits_of(y_row, r_row).double(), -1)
            fisher = j.T @ (torch.diag(p) - torch.outer(p, p)) @ j
            total += fisher.diagonal().detach()
            count += 1
    return total / count


def test_down_proj_of_the_last_block_approaches_the_expected_fisher(peaky):
    model, batches = peaky
    got = output_fisher(model, batches, [DOWN], seed=0)[DOWN]
    want = _expected_down_proj_fisher(model, batches[:2])  # 512 positions are plenty for the expectation's shape
    assert got.shape == (64,) and got.dtype == torch.float64 and bool((got >= 0).all())
    assert float((got - want).norm() / want.norm()) < 0.12  # measured: 0.05 for three seeds
    assert float(torch.corrcoef(torch.stack([got, want]))[0, 1]) > 0.9


def test_the_heads_fisher_sums_to_the_expected_sum_of_p_times_1_minus_p(peaky):
    model, batches = peaky
    got = output_fisher(model, batches, ["lm_head.weight"], seed=3)["lm_head.weight"]
    with torch.no_grad():
        p = torch.cat([torch.softmax(model(b, use_cache=False).logits.double(), -1).flatten(0, 1) for b in batches])
    want = float((p * (1 - p)).sum(1).mean())
    assert float(got.sum()) == pytest.approx(want, rel=0.05)


def test_masked_positions_are_left_out_and_the_model_is_left_as_it_was(peaky):
    model, batches = peaky
    b = batches[0]
    plain = output_fisher(model, [b], [DOWN], seed=5)[DOWN]
    ones = output_fisher(model, [{"input_ids": b, "attention_mask": torch.ones_like(b)}], [DOWN], seed=5)[DOWN]
    torch.testing.assert_close(ones, plain, rtol=1e-6, atol=0)
    assert all(p.requires_grad and p.grad is None for p in model.parameters()) and not model.training


def test_bad_paths_and_models_are_refused_by_name(peaky):
    model, batches = peaky
    with pytest.raises(ValueError, match="'model.layers.9.mlp.down_proj.weight' is not a weight"):
        output_fisher(model, batches[:1], ["model.layers.9.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="no input embedding"):
        output_fisher(torch.nn.Sequential(torch.nn.Linear(4, 4)), [torch.zeros(1, 4)], ["0.weight"])


def test_the_fisher_batches_are_spread_over_the_calibration_and_bad_counts_are_refused():
    b = [torch.zeros(2, 16, dtype=torch.long)] * 10  # 32 positions each
    assert fisher_batches(b, None) == list(range(10)) and fisher_batches(b, 10**6) == list(range(10))
    assert fisher_batches(b, 1) == [0] and fisher_batches(b, 32) == [0]
    assert fisher_batches(b, 64) == [0, 5] and fisher_batches(b, 96) == [0, 3, 6]
    masked = [{"input_ids": x, "attention_mask": torch.ones_like(x)[:, :8]} for x in b]  # 16 positions each
    assert fisher_batches(masked, 64) == [0, 2, 5, 7]
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="fisher_tokens must be a positive int or None"):
            fisher_batches(b, bad)


def test_a_fisher_subset_is_the_fisher_of_those_batches_and_the_hessians_fold_every_batch(peaky):
    """Batches 0 and 4 of 8 carry the Fisher (forward and backward, sequence by sequence), the others run without
    the head; the Hessian of each input is XᵀX/n over all 8 batches, the Fisher that of batches 0 and 4 alone with
    the same seed."""
    model, batches = peaky
    heads = []
    handle = model.lm_head.register_forward_hook(lambda m, a, o: heads.append(a[0].shape))
    sites = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    fisher, hessians = fisher_pass(model, batches, [DOWN], hessian_modules=sites, fisher_tokens=512, seed=4)
    handle.remove()
    assert len(heads) == 16 and all(h[0] == 1 for h in heads)  # batches 0 and 4, one sequence at a time
    torch.testing.assert_close(fisher[DOWN], output_fisher(model, [batches[0], batches[4]], [DOWN], seed=4)[DOWN],
                               rtol=1e-12, atol=0)
    for site in sites:
        seen = []
        h = model.get_submodule(site).register_forward_hook(lambda m, a, o: seen.append(a[0].detach().flatten(0, -2)))
        with torch.no_grad():
            for b in batches:
                model(b, use_cache=False)
        h.remove()
        x = torch.cat(seen).double()
        torch.testing.assert_close(hessians[site].double(), x.T @ x / x.shape[0], rtol=1e-5, atol=1e-7)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
