"""bench_qat's own plumbing: the steps of each row, the run order of the budgets, the merged tables, the peer's command
line round trip, its batches, and torchao's QAT run by the peer on a tiny Llama (hidden 128, 2 layers): trained,
converted to at most 2^bits values per group, and refused where the group size does not divide in_features."""

import pathlib
import sys

import pytest
import torch

import qtransform as qt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import bench_qat as bench  # noqa: E402
import peer_torchao_qat as peer  # noqa: E402
from peer_autoround import distinct_per_group  # noqa: E402


def test_steps_of_each_row():
    kw = dict(iters=3, batch_size=2)
    assert bench.steps_of("rtn", **kw) == []
    assert bench.steps_of("gptaq", **kw) == [qt.Step("gptq", gptaq=True)]
    assert bench.steps_of("signround_gptaq", **kw) == [qt.Step("signround", init="gptaq", iters=3, batch_size=2)]
    assert bench.steps_of("qat_gptaq", **kw) == [qt.Step("qat", init="gptaq", iters=3, batch_size=2)]
    assert bench.steps_of("qat_minmax", **kw) == [qt.Step("qat", init="minmax", iters=3, batch_size=2)]
    for m in bench.METHODS:
        if m not in bench.PEER:
            assert bench.unavailable(bench.steps_of(m, **kw)) is None, m
    with pytest.raises(ValueError, match="torchao"):
        bench.steps_of("torchao", **kw)


def test_the_w4a4_rows_are_the_quarot_preset_with_their_steps_after_its_rotations():
    preset = qt.get_preset("quarot-w4a4").recipe
    kw = dict(iters=3, batch_size=2)
    assert bench.recipe_of(bench.W4A4, bench.steps_of("gptq", **kw)) == preset  # the preset itself
    qat = bench.recipe_of(bench.W4A4, bench.steps_of("qat_gptaq", **kw))
    assert list(qat.steps) == [qt.Step("rotate"), qt.Step("qat", init="gptaq", iters=3, batch_size=2)]
    assert (qat.input, qat.type_rules, qat.exclude) == (preset.input, preset.type_rules, preset.exclude)
    assert qat.input.format == "int4" and qat.input.dynamic
    weight_only = bench.recipe_of("uint3-asym-g64", [])
    assert weight_only.input is None and not weight_only.steps
    assert bench.merge([], [_row(bench.W4A4, "rtn", None, 9.0), _row("uint2-asym-g64", "rtn", None, 9.0)])[-1][
        "scheme"] == bench.W4A4


def test_jobs_run_every_learned_row_at_every_budget():
    assert bench.jobs(["uint2-asym-g64"], ["rtn", "qat_gptaq", "torchao"], [25, 50]) == [
        ("uint2-asym-g64", "rtn", None), ("uint2-asym-g64", "qat_gptaq", 25), ("uint2-asym-g64", "qat_gptaq", 50),
        ("uint2-asym-g64", "torchao", 25), ("uint2-asym-g64", "torchao", 50)]


def _row(scheme, method, iters, ratio, **kw):
    return {"scheme": scheme, "method": method, "iters": iters, "tokens": (iters or 0) * 2048, "ratio": [ratio, 1.0],
            "seconds": 1.0, "peak_gib": 2.0, "load_gib": 1.0, **kw}


def test_merge_keeps_unrepeated_rows_and_tables_show_the_curve_and_refusals():
    old = [_row("uint2-asym-g64", "qat_gptaq", 50, 3.0), _row("uint2-asym-g64", "rtn", None, 99.0),
           _row("uint4-asym-g128", "qat_gptaq", 25, 1.1)]
    new = [_row("uint2-asym-g64", "qat_gptaq", 25, 3.5), _row("uint2-asym-g64", "rtn", None, 90.0),
           {"scheme": "uint4-asym-g128", "method": "torchao", "iters": 25, "tokens": 51200, "refused": "no 576 % 128"}]
    rows = bench.merge(old, new)
    assert [(r["scheme"], r["method"], r["iters"]) for r in rows] == [
        ("uint4-asym-g128", "qat_gptaq", 25), ("uint4-asym-g128", "torchao", 25), ("uint2-asym-g64", "rtn", None),
        ("uint2-asym-g64", "qat_gptaq", 25), ("uint2-asym-g64", "qat_gptaq", 50)]
    assert next(r for r in rows if r["method"] == "rtn")["ratio"][0] == 90.0
    t = bench.table(rows, "uint4-asym-g128").splitlines()
    assert t[2].startswith("| QAT (Block-AP) from GPTAQ | 25 | 51200 | x1.1 | x1.0 | 1.0 | 2.0 (1.0) |")
    assert "refused: no 576 % 128" in t[3]
    c = bench.curve(rows).splitlines()
    assert c[0] == "| method | scheme | 25 it | 50 it |"
    assert "| QAT (Block-AP) from GPTAQ | uint2-asym-g64 | x3.5 | x3.0 |" in c
    assert "| torchao QAT, integer zero point | uint4-asym-g128 | refused | - |" in c


def test_peer_command_round_trips_through_the_peer_parser():
    files = {"model": "/m", "calib": "c.pt", "eval": ["o.pt", "b.pt"]}
    cmd = bench.peer_command("/venv/bin/python", files, "uint3-asym-g64", "torchao_fzp", iters=7, batch_size=4,
                             lr=3e-5, threads=2, out="r.json")
    assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("peer_torchao_qat.py")
    a = peer.parser().parse_args(cmd[2:])
    assert (a.model, a.tokens, a.eval, a.out) == ("/m", "c.pt", ["o.pt", "b.pt"], "r.json")
    assert (a.bits, a.group_size, a.iters, a.batch_size, a.lr, a.zero_point) == (3, 64, 7, 4, 3e-5, "float")


def test_peer_batches_are_seeded_epochs():
    got = [b.tolist() for b in peer.batches(5, 2, 5, seed=0)]
    assert len(got) == 5 and all(len(b) == 2 for b in got)
    flat = sum(got, [])
    assert sorted(flat[:5]) == list(range(5))  # the first epoch is a permutation
    assert got == [b.tolist() for b in peer.batches(5, 2, 5, seed=0)]


@pytest.fixture()
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval(), torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("zero_point", ["int", "float"])
def test_peer_trains_and_converts_a_tiny_llama(tiny, zero_point):
    pytest.importorskip("torchao")
    model, calib = tiny
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    a = peer.parser().parse_args(["--model", "-", "--tokens", "-", "--eval", "-", "--bits", "2", "--group-size", "64",
                                  "--iters", "2", "--batch-size", "2", "--lr", "1e-3", "--zero-point", zero_point,
                                  "--out", "-"])
    losses, refused = peer.train(model, calib, a)
    assert refused is None and len(losses) == 2
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert distinct_per_group(model, 64) == (4, 14)  # 7 linears a layer, the head left float
    assert not torch.equal(before, model.model.layers[0].mlp.up_proj.weight)


def test_peer_refuses_a_group_that_does_not_divide_in_features(tiny):
    pytest.importorskip("torchao")
    model, calib = tiny
    a = peer.parser().parse_args(["--model", "-", "--tokens", "-", "--eval", "-", "--bits", "4", "--group-size", "96",
                                  "--iters", "1", "--batch-size", "1", "--out", "-"])
    losses, refused = peer.train(model, calib, a)
    assert losses == [] and "group_size" in refused
    assert "symmetric" in peer.base_config_route(2, 64)  # torchao's word on the asymmetric PTQ base config
