"""What a learned block-by-block step needs from the runner: gradients through ``Block.call`` and ``Block.run``
equal to finite differences (they used to run under no_grad: torch.func.grad gave zeros), and the float model's
block inputs beside the quantized chain's (``BlockInputs(float_inputs=...)``), in memory and streamed alike."""

from __future__ import annotations

import pytest
import torch

import bridge
import qtransform as qt
from bridge.calibrate import find_blocks
from bridge_util import hidden_into, tiny_causal_lm

SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
RECIPE = dict(type_rules={"Linear": SPEC, "Conv1D": SPEC}, exclude=["lm_head*"])
BATCHES = [torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1)),
           torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))]


@pytest.fixture
def probe():
    """A step that records, per block, its inputs, float inputs, and the gradients it takes through call/run."""
    seen = []

    def fn(params, plan, *, context, learn=False):
        b = context.block
        row = {"name": b.name, "float": b.float_inputs, "inputs": b.inputs}
        if b.float_outputs is not None:
            row["outputs"] = (b.float_outputs(), b.float_outputs())
        if learn:
            w = next(p for p in b.paths if p in plan.specs)
            args, kwargs = b.inputs[0]

            def through_call(t):
                out = b.call(b.name, {w: t}, args, kwargs)
                return (out[0] if isinstance(out, tuple) else out).pow(2).sum()

            def through_run(t):
                out = b.run({w: t})
                return sum((o[0] if isinstance(o, tuple) else o).pow(2).sum() for o in out)

            d = torch.randn(params[w].shape, dtype=params[w].dtype, generator=torch.Generator().manual_seed(3))
            eps = 1e-3  # central differences: O(eps²); transformers keeps the rotary tables in float32
            for key, f in (("call", through_call), ("run", through_run)):
                g = torch.func.grad(f)(params[w])
                fd = (f(params[w] + eps * d) - f(params[w] - eps * d)) / (2 * eps)
                row[key] = (float((g * d).sum()), float(fd), float(g.abs().max()))
        seen.append(row)
        return qt.Fit()

    qt.register_algorithm("float_probe", fn, needs=qt.BlockInputs(float_inputs=lambda learn=False: True))
    qt.register_algorithm("plain_probe", fn, needs=qt.BlockInputs())
    yield seen
    qt.ALGORITHMS.unregister("float_probe")
    qt.ALGORITHMS.unregister("plain_probe")


def _first(pairs):
    return [a[0] if a else k["hidden_states"] for a, k in pairs]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_gradient_through_call_and_run_equals_a_finite_difference(arch, probe):
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval().double()
    bridge.quantize(model, qt.Recipe(**RECIPE, steps=[qt.Step("float_probe", learn=True)]), calibration=BATCHES,
                    kernel="dequant")
    assert len(probe) == 2
    for row in probe:
        for key in ("call", "run"):
            directional, fd, biggest = row[key]
            assert biggest > 0, f"{row['name']} {key}: an all-zero gradient"
            assert directional == pytest.approx(fd, rel=1e-3, abs=1e-7)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_float_inputs_are_the_float_models_and_inputs_the_quantized_chains(arch, probe):
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval()
    qm = bridge.quantize(model, qt.Recipe(**RECIPE, steps=["float_probe"]), calibration=BATCHES, kernel="dequant")
    names = list(find_blocks(model))
    assert [r["name"] for r in probe] == names
    for row in probe:
        want_float = hidden_into(model, row["name"], BATCHES)  # hooks on the float model: the reference
        want_quant = hidden_into(qm, row["name"], BATCHES)  # ... and on the result (round to nearest)
        for got, want in zip(_first(row["float"]), want_float):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(_first(row["inputs"]), want_quant):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    last = probe[-1]
    assert not torch.allclose(_first(last["float"])[0], _first(last["inputs"])[0])  # the two chains differ


def test_a_step_that_does_not_ask_gets_no_float_inputs(probe):
    model = tiny_causal_lm("llama").eval()
    bridge.quantize(model, qt.Recipe(**RECIPE, steps=["plain_probe"]), calibration=BATCHES, kernel="dequant")
    assert probe and all(r["float"] is None for r in probe)


def test_a_streamed_run_hands_the_same_float_inputs(probe, tmp_path):
    from bridge.stream import quantize_checkpoint
    from stream_util import save_tiny
    from transformers import AutoModelForCausalLM

    src = save_tiny("llama", tmp_path / "src", dtype=torch.float32)
    recipe = qt.Recipe(**RECIPE, steps=["float_probe"])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    bridge.quantize(model, recipe, calibration=BATCHES, kernel="dequant")
    memory = [(r["name"], _first(r["float"]), _first(r["inputs"])) for r in probe]
    probe.clear()
    quantize_checkpoint(src, tmp_path / "out", recipe, calibration=BATCHES)
    streamed = [(r["name"], _first(r["float"]), _first(r["inputs"])) for r in probe]
    assert [m[0] for m in memory] == [s[0] for s in streamed]
    for (_, mf, mi), (_, sf, si) in zip(memory, streamed):
        for a, b in zip(mf + mi, sf + si):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_float_outputs_run_once_are_the_float_blocks_and_become_the_next_float_inputs(probe):
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    names = list(find_blocks(model))
    want = [hidden_into(model, n, BATCHES) for n in names[1:]]  # hooks on the float model: block i's outputs
    calls = []
    handles = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: calls.append(n) and None)
               for n in names]
    bridge.quantize(model, qt.Recipe(**RECIPE, steps=["float_probe"]), calibration=BATCHES, kernel="dequant")
    for h in handles:
        h.remove()
    # per block: the float pass (asked twice, run once) and the quantized pass for the next inputs; the first
    # block once more per batch: the capture of each block's own inputs runs it
    assert calls.count(names[0]) - len(BATCHES) == calls.count(names[1]) == 2 * len(BATCHES)
    for i, row in enumerate(probe):
        first, again = row["outputs"]
        assert all(a is b for a, b in zip(first, again))
        if i + 1 < len(probe):
            for got, nxt, ref in zip(first, _first(probe[i + 1]["float"]), want[i]):
                assert got is nxt  # handed on as they are
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
