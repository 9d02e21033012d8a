"""``qt.rotate`` with stacked experts weights: ``gate_up_proj`` (experts, 2I, d) reads the stream, ``down_proj``
(experts, d, I) and its bias ``down_proj_bias`` (experts, d) write it, each expert rotated in one batched
product. A hand-written residual MoE block before and after is the independent check."""

import pytest
import torch

import qtransform as qt
from qtransform.rotation import NormReaders, ResidualLayout

E, D, I, V = 3, 8, 4, 11


def _params():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"emb": r(V, D), "n": torch.rand(D, generator=g, dtype=torch.float64) + 0.5, "router": r(E, D),
            "experts.gate_up_proj": r(E, 2 * I, D), "experts.down_proj": r(E, D, I),
            "experts.down_proj_bias": r(E, D), "final": torch.rand(D, generator=g, dtype=torch.float64) + 0.5,
            "head": r(V, D)}


LAYOUT = ResidualLayout(embeddings=("emb",), norms=(
    NormReaders("n", ("router", "experts.gate_up_proj")), NormReaders("final", ("head",))),
    writers=("experts.down_proj",))


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _model(p, ids):
    x = p["emb"][ids]
    h = _rms(x, p["n"])
    probs = torch.softmax(h @ p["router"].T, -1)
    y = torch.zeros_like(x)
    for e in range(E):
        gu = h @ p["experts.gate_up_proj"][e].T
        out = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ p["experts.down_proj"][e].T
        y = y + probs[:, e:e + 1] * (out + p["experts.down_proj_bias"][e])
    return _rms(x + y, p["final"]) @ p["head"].T


def test_rotating_stacked_experts_keeps_the_function():
    p = _params()
    ids = torch.tensor([0, 3, 7, 10, 5])
    R = qt.rotation.random_orthogonal(D, 1, dtype=torch.float64)
    r = qt.rotate(p, LAYOUT, R)
    assert torch.allclose(_model(r, ids), _model(p, ids), atol=1e-10)
    for e in range(E):  # each expert as one matrix would be
        assert torch.allclose(r["experts.down_proj"][e], R.T @ p["experts.down_proj"][e])
        assert torch.allclose(r["experts.down_proj_bias"][e], p["experts.down_proj_bias"][e] @ R)


def test_a_stacked_writer_of_another_width_is_named():
    p = {**_params(), "experts.down_proj": torch.randn(E, D + 1, I, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"writer 'experts.down_proj' has shape \(3, 9, 4\); its axis 1 must be the residual width 8"):
        qt.rotate(p, LAYOUT, torch.eye(D, dtype=torch.float64))
