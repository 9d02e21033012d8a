"""The same collectives over NCCL (tests marked ``cuda``: ``make test-gpu`` on a GPU machine). One GPU holds one
NCCL rank, so the group has one process: what this checks is that every collective of ``TorchParallel`` runs on
CUDA tensors (object collectives through the host, reductions on the rank's device) and gives the fold's result."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import qtransform as qt

sys.path.insert(0, str(Path(__file__).parent))
from dist_util import run_ranks  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SPEC = qt.QuantSpec(format="int8", granularity=qt.PerChannel(-1))


def _job(rank, world):
    from bridge.distributed import TorchParallel

    par = TorchParallel()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(7, 16, generator=g).cuda() for _ in range(3)]
    out = {"comm": str(par.comm), "device": str(par.device)}
    for name in ("hessian", "percentile", "minmax"):
        s = qt.init_stats(None if name == "hessian" else SPEC, observer=name)
        for x in xs:
            s = qt.observe(s, x)
        for owners in (None, {"s": 0}):
            got = par.reduce_stats({"s": s}, owners)["s"]
            out[f"{name}-{owners is None}"] = all(
                a.device.type == "cuda" and torch.equal(a, b) for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(s)))
    w = torch.randn(8, 32, generator=g).cuda()
    q = qt.quantize(w, qt.choose_qparams(w, qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))))
    shared = par.share({"w": q}, {"w": 0})["w"]
    out["share"] = shared.codes.device.type == "cuda" and torch.equal(qt.dequantize(shared), qt.dequantize(q))
    out["sum"] = par.all_sum(torch.ones(3, device="cuda", dtype=torch.float64)).tolist()
    out["gather"] = par.gather({"r": rank})
    return out


def test_torch_parallel_collectives_run_on_cuda_over_nccl():
    (got,) = run_ranks(1, _job, backend="nccl", timeout=120)
    assert got.pop("comm").startswith("cuda") and got.pop("device").startswith("cuda")
    assert got.pop("sum") == [1.0, 1.0, 1.0] and got.pop("gather") == [{"r": 0}]
    assert all(got.values()), got
