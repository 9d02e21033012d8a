"""bench_signround's own plumbing on a tiny Llama (hidden 128, 2 layers): the steps of each row, which rows this
checkout cannot run and why, one ``measure`` run (ours only; auto-round needs its own virtualenv), the merged table,
and the peer script's pieces that run without auto-round: its command line round trip, its check that weights are
quantized (distinct values per group, counted by hand) and its perplexity against ours."""

import pathlib
import sys

import pytest
import torch

import qtransform as qt
from bridge.app import evaluate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import bench_signround as bench  # noqa: E402
import peer_autoround  # noqa: E402
from peer_llmcompressor import perplexity as peer_perplexity  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    cal = torch.randint(0, 64, (4, 32), generator=gen)
    ev = torch.randint(0, 64, (3, 32), generator=gen)
    return model, cal, ev


def test_steps_of_each_row():
    sr = qt.Step("signround", iters=3, batch_size=2, lr=0.5)
    kw = dict(iters=3, batch_size=2, lr=0.5)
    assert bench.steps_of("rtn", **kw) == []
    assert bench.steps_of("gptaq", **kw) == [qt.Step("gptq", gptaq=True)]
    assert bench.steps_of("awq_signround", **kw) == [qt.Step("awq", clip=False), sr]
    assert bench.steps_of("signround+lowrank32", **kw) == [sr, qt.Step("lowrank", rank=32)]
    assert bench.steps_of("rtn+lowrank32", **kw) == [qt.Step("lowrank", rank=32)]
    assert bench.steps_of("signround_mse", **kw) == [qt.Step("signround", iters=3, batch_size=2, lr=0.5, init="mse")]
    assert bench.steps_of("signround_gptq", **kw) == [qt.Step("signround", iters=3, batch_size=2, init="gptq")]
    assert bench.steps_of("signround_gptaq", **kw) == [qt.Step("signround", iters=3, batch_size=2, init="gptaq")]
    assert bench.steps_of("signround_clip", **kw) == [qt.Step("signround", iters=3, batch_size=2, lr=0.5,
                                                              offsets=False)]
    assert bench.steps_of("signround", amp=True, **kw) == [qt.Step("signround", iters=3, batch_size=2, lr=0.5,
                                                                   amp=True)]
    assert len(bench.METHODS) == 21 and bench.METHODS[-1] == "autoround"
    with pytest.raises(ValueError, match="signround2"):
        bench.steps_of("signround2", **kw)


def test_unavailable_names_the_step_or_the_option():
    assert bench.unavailable([]) is None
    assert bench.unavailable([qt.Step("gptq")]) is None
    assert "not registered" in bench.unavailable([qt.Step("gptq"), qt.Step("no_such_step_33")])
    assert "no_such_option" in bench.unavailable([qt.Step("gptq", no_such_option=1)])


def test_spec_of_each_width():
    for name, (bits, group) in bench.SCHEMES.items():
        spec = bench.spec_of(name)
        assert spec.format == f"uint{bits}" and spec.granularity == qt.PerGroup(group) and not spec.symmetric


def test_measure_runs_ours_and_reports_what_it_cannot_run(tiny):
    model, cal, ev, = tiny
    with torch.no_grad():
        fp = evaluate.perplexity(model, ev).perplexity
    methods = ["rtn", "gptq", "signround", "autoround"]
    rows, skipped = bench.measure(model, cal, ev, fp, schemes=["uint4-asym-g128", "uint2-asym-g64"], methods=methods,
                                  iters=2, batch_size=1, lr=0.5, threads=1)
    assert skipped["autoround"] == "no --peer-python"
    why = bench.unavailable(bench.steps_of("signround", iters=2, batch_size=1, lr=0.5))
    ran = ["rtn", "gptq"] + (["signround"] if why is None else [])
    if why is not None:
        assert skipped["signround"] == why
    assert [(r["scheme"], r["method"]) for r in rows] == [(s, m) for s in ("uint4-asym-g128", "uint2-asym-g64")
                                                          for m in ran]
    for r in rows:
        assert r["ratio"] == pytest.approx(r["ppl"] / fp, abs=1e-3) and r["seconds"] >= 0
        assert ("settings" in r) == (r["method"] == "signround")
    rtn = {r["scheme"]: r["ppl"] for r in rows if r["method"] == "rtn"}
    assert rtn["uint4-asym-g128"] != rtn["uint2-asym-g64"]  # the widths reach the quantizer


def test_merge_keeps_unrepeated_rows_in_table_order_and_table_marks_other_settings():
    s = {"iters": 4, "batch_size": 1, "lr": 0.25}
    old = [{"scheme": "uint2-asym-g64", "method": "autoround", "ratio": 9.0, "seconds": 500.0, "settings": s},
           {"scheme": "uint2-asym-g64", "method": "rtn", "ratio": 50.0, "seconds": 1.0},
           {"scheme": "uint4-asym-g128", "method": "rtn", "ratio": 1.3, "seconds": 1.0}]
    new = [{"scheme": "uint2-asym-g64", "method": "rtn", "ratio": 40.0, "seconds": 2.0},
           {"scheme": "uint2-asym-g64", "method": "gptq", "ratio": 3.0, "seconds": 100.0}]
    rows = bench.merge(old, new)
    assert [(r["scheme"], r["method"], r["ratio"]) for r in rows] == [
        ("uint4-asym-g128", "rtn", 1.3), ("uint2-asym-g64", "rtn", 40.0), ("uint2-asym-g64", "gptq", 3.0),
        ("uint2-asym-g64", "autoround", 9.0)]
    assert bench.table(rows, s).splitlines() == [
        "| method | uint4-asym-g128 | uint3-asym-g64 | uint2-asym-g64 |", "|---|---|---|---|",
        "| RTN | x1.3, 1.0 s | - | x40.0, 2.0 s |", "| GPTQ | - | - | x3.0, 100.0 s |",
        "| auto-round (intel, same run) | - | - | x9.0, 500.0 s |"]
    assert "x9.0, 500.0 s (4 it, batch 1, lr 0.25)" in bench.table(rows, {**s, "iters": 8})


def test_peer_command_round_trips_through_the_peer_parser():
    cmd = bench.peer_command("/venv/bin/python", ("c.pt", "e.pt", "/m"), "uint3-asym-g64", iters=7, batch_size=2,
                             lr=1 / 7, threads=3, out="r.json")
    assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("peer_autoround.py")
    a = peer_autoround.parser().parse_args(cmd[2:])
    assert (a.model, a.tokens, a.eval, a.out) == ("/m", "c.pt", "e.pt", "r.json")
    assert (a.bits, a.group_size, a.sym, a.iters, a.batch_size, a.threads, a.amp) == (3, 64, False, 7, 2, 3, False)
    assert a.lr == 1 / 7  # exactly: repr round-trips a float


def test_peer_counts_distinct_values_per_group():
    model = torch.nn.Module()
    model.a = torch.nn.Linear(8, 2, bias=False)
    model.lm_head = torch.nn.Linear(8, 2, bias=False)  # the head is not checked
    with torch.no_grad():
        model.a.weight.copy_(torch.tensor([[0.0, 1, 1, 2, 5, 5, 5, 5], [3, 3, 3, 3, -1, 0, 1, 2]]))
        model.lm_head.weight.copy_(torch.arange(16.0).reshape(2, 8))
    assert peer_autoround.distinct_per_group(model, 4) == (4, 1)  # groups: 3, 1, 1, 4 distinct values
    assert peer_autoround.distinct_per_group(model, 8) == (5, 1)  # rows: {0,1,2,5}, {3,-1,0,1,2}
    # groups of 3: [0,1,1] [2,5,5] [5,5] and [3,3,3] [3,-1,0] [1,2]: at most 3 distinct values
    assert peer_autoround.distinct_per_group(model, 3) == (3, 1)
    assert peer_autoround.distinct_per_group(model, 5) == (4, 1)  # [3,3,3,3,-1] [0,1,2]; [0,1,1,2,5] [5,5,5]


def test_peer_perplexity_is_ours(tiny):
    model, _, ev = tiny
    with torch.no_grad():
        ours = evaluate.perplexity(model, ev).perplexity
    assert peer_perplexity(model, ev) == pytest.approx(ours, rel=1e-5)
