"""``qt.rotate`` on a small transformer written out here (embedding, RMSNorm, grouped-query attention,
gated MLP, final norm, head): the rotated tree computes the same logits, its weights did change, and
bad layouts are named."""

import math

import pytest
import torch

import qtransform as qt
from qtransform.rotation import HeadPair, NormReaders, ResidualLayout, fuse_norms, orthogonal, rotate

D, HD, NQ, NKV, F, V = 24, 4, 6, 2, 40, 30


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / math.sqrt(s[-1])  # noqa: E731
    return {"emb": torch.randn(V, D, generator=g, dtype=torch.float64), "n1": torch.rand(D, generator=g).double() + .5,
            "q.weight": r(NQ * HD, D), "k.weight": r(NKV * HD, D), "v.weight": r(NKV * HD, D), "v.bias": r(NKV * HD), "o.weight": r(D, NQ * HD),
            "o.bias": r(D), "n2": torch.rand(D, generator=g).double() + .5, "gate.weight": r(F, D), "up.weight": r(F, D),
            "down.weight": r(D, F), "nf": torch.rand(D, generator=g).double() + .5, "head.weight": r(V, D)}


LAYOUT = ResidualLayout(embeddings=("emb",), norms=(NormReaders("n1", ("q.weight", "k.weight", "v.weight")),
                                                   NormReaders("n2", ("gate.weight", "up.weight")),
                                                   NormReaders("nf", ("head.weight",))),
                        writers=("o.weight", "down.weight"), heads=(HeadPair("v.weight", "o.weight", HD),))


def _rms(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g


def _logits(p, ids):
    x = p["emb"][ids]  # (T, D)
    h = _rms(x, p["n1"])
    q, k = (h @ p["q.weight"].T).reshape(-1, NQ, HD), (h @ p["k.weight"].T).reshape(-1, NKV, HD)
    v = (h @ p["v.weight"].T + p["v.bias"]).reshape(-1, NKV, HD)
    k, v = k.repeat_interleave(NQ // NKV, 1), v.repeat_interleave(NQ // NKV, 1)
    a = torch.einsum("thd,shd->hts", q, k) / math.sqrt(HD)
    a = a.masked_fill(torch.triu(torch.ones(len(ids), len(ids), dtype=torch.bool), 1), -torch.inf).softmax(-1)
    x = x + torch.einsum("hts,shd->thd", a, v).reshape(len(ids), -1) @ p["o.weight"].T + p["o.bias"]
    h = _rms(x, p["n2"])
    x = x + (torch.nn.functional.silu(h @ p["gate.weight"].T) * (h @ p["up.weight"].T)) @ p["down.weight"].T
    return _rms(x, p["nf"]) @ p["head.weight"].T


def test_the_rotated_tree_computes_the_same_logits():
    p, ids = _params(), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    R1, R2 = orthogonal(D, seed=1, dtype=torch.float64), orthogonal(HD, seed=2, dtype=torch.float64)
    r = rotate(p, LAYOUT, R1, R2)
    assert torch.allclose(_logits(r, ids), _logits(p, ids), atol=1e-10)
    assert all(not torch.allclose(r[k], p[k]) for k in ("emb", "q.weight", "v.weight", "v.bias", "o.weight", "o.bias", "down.weight",
                                                          "head.weight"))
    assert all(torch.equal(r[n], torch.ones(D, dtype=torch.float64)) for n in ("n1", "n2", "nf"))
    assert torch.allclose(_logits(rotate(p, LAYOUT._replace(heads=()), R1), ids), _logits(p, ids), atol=1e-10)
    assert torch.equal(p["n1"], _params()["n1"])  # pure


def test_rotation_spreads_an_outlier_channel():
    """An embedding column 30x the others: after a Hadamard rotation no column stands out."""
    p = _params()
    p["emb"][:, 5] *= 30
    r = rotate(p, LAYOUT, qt.hadamard(D, dtype=torch.float64))
    col = lambda e: e.abs().amax(0)  # noqa: E731
    assert col(p["emb"]).max() / col(p["emb"]).median() > 10
    assert col(r["emb"]).max() / col(r["emb"]).median() < 3


def test_fuse_norms_alone_keeps_the_function():
    p, ids = _params(), torch.tensor([1, 2, 3])
    assert torch.allclose(_logits(fuse_norms(p, LAYOUT), ids), _logits(p, ids), atol=1e-12)


def test_bad_layouts_and_matrices_are_named():
    p, R = _params(), orthogonal(D, dtype=torch.float64)
    with pytest.raises(ValueError, match="writer 'emb' has shape \\(30, 24\\); its axis 0 must be the residual width 24"):
        rotate(p, LAYOUT._replace(writers=("emb",)), R)
    with pytest.raises(ValueError, match="reader of n1 'nope' is not a tensor of the tree"):
        rotate(p, LAYOUT._replace(norms=(NormReaders("n1", ("nope",)),)), R)
    with pytest.raises(ValueError, match="norm 'n1' has a bias"):
        rotate({**p, "bias": torch.zeros(D)}, LAYOUT._replace(norms=(NormReaders("n1", ("q.weight",)),)), R)
    with pytest.raises(ValueError, match="R1 must be a square matrix"):
        rotate(p, LAYOUT, torch.ones(D, 3))
    with pytest.raises(ValueError, match="whole heads of width 4 matching R2 \\(3, 3\\)"):
        rotate(p, LAYOUT, R, torch.eye(3))
    with pytest.raises(TypeError, match="layout must be a ResidualLayout"):
        rotate(p, {}, R)
    w = p["q.weight"].float()
    q = {**p, "q.weight": qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="int8")))}
    with pytest.raises(ValueError, match="holds QTensor, not a float tensor \\(rotate before quantizing\\)"):
        rotate(q, LAYOUT, R)
