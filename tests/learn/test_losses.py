"""qtransform.learn.losses: the distillation and hidden-state losses against torch's own formulas, their
invariances, masks, torch.func transforms, and bad input refused by name."""

import pytest
import torch
import torch.nn.functional as F

from qtransform import learn


def logits(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_kl_to_teacher_is_torch_kl_div_over_positions():
    s, t = logits(2, 5, 11), logits(2, 5, 11, seed=1)
    for temperature in (1.0, 2.5):
        ls, lt = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
        expected = F.kl_div(ls.reshape(-1, 11), lt.reshape(-1, 11), log_target=True, reduction="batchmean")
        assert torch.allclose(learn.kl_to_teacher(s, t, temperature=temperature), expected * temperature ** 2,
                              rtol=1e-5)


def test_kl_to_teacher_properties():
    s, t = logits(3, 7), logits(3, 7, seed=1)
    assert learn.kl_to_teacher(t, t) == 0
    assert learn.kl_to_teacher(s, t) > 0
    shifted = learn.kl_to_teacher(s + 4.0, t - 2.0)  # softmax is shift-invariant per position
    assert torch.allclose(shifted, learn.kl_to_teacher(s, t), rtol=1e-5)
    mask = torch.tensor([1.0, 0.0, 1.0])
    assert torch.allclose(learn.kl_to_teacher(s, t, mask=mask), learn.kl_to_teacher(s[[0, 2]], t[[0, 2]]), rtol=1e-6)
    assert learn.kl_to_teacher(s.to(torch.bfloat16), t.to(torch.bfloat16)).dtype == torch.float32


def test_hidden_mse():
    s, t = logits(2, 4, 6), logits(2, 4, 6, seed=1)
    assert torch.allclose(learn.hidden_mse(s, t), F.mse_loss(s, t))
    rel = learn.hidden_mse(s, t, normalize=True)
    assert torch.allclose(rel, F.mse_loss(s, t) / t.square().mean())
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    keep = mask.bool()
    assert torch.allclose(learn.hidden_mse(s, t, mask=mask), F.mse_loss(s[keep], t[keep]))


def test_pure_and_transformable():
    s, t = logits(4, 9), logits(4, 9, seed=1)
    s0, t0 = s.clone(), t.clone()
    g = torch.func.grad(lambda x: learn.kl_to_teacher(x, t, temperature=2.0))(s)
    # d/ds of T² · mean KL = T · (softmax(s/T) - softmax(t/T)) / positions
    expected = 2.0 * (F.softmax(s / 2, -1) - F.softmax(t / 2, -1)) / 4
    assert torch.allclose(g, expected, atol=1e-6)
    per_row = torch.func.vmap(lambda a, b: learn.hidden_mse(a, b))(s, t)
    assert torch.allclose(per_row, (s - t).square().mean(-1))
    assert torch.equal(s, s0) and torch.equal(t, t0)


def test_bad_input_named():
    s = logits(2, 5)
    with pytest.raises(ValueError, match=r"student_logits \(2, 5\) and teacher_logits \(2, 4\) differ in shape"):
        learn.kl_to_teacher(s, s[:, :4])
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        learn.kl_to_teacher(s, s, temperature=0)
    with pytest.raises(ValueError, match=r"mask of shape \(5,\) does not match the positions \(2,\)"):
        learn.kl_to_teacher(s, s, mask=torch.ones(5))
    with pytest.raises(TypeError, match="teacher"):
        learn.hidden_mse(s, s.long())
