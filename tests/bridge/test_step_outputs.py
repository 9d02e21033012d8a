"""One slot for new kinds of step output: a toy kind (a learned scale per output row of a quantized linear)
declared in this file only — its core kind, its bridge slot and a step returning it — goes end to end:
the pipeline carries it, ``bridge.to_module`` attaches it, ``bridge.save`` -> ``bridge.load`` and
``from_pretrained`` bring back the same values, and what cannot carry it (an exporter, a streamed run,
``model.dequantize()``) refuses it by name. No library file names the kind."""

import json

import pytest
import torch

import bridge
import qtransform as qt
from bridge.modules import QLinear
from bridge.step_outputs import SLOTS, OutputSlot, read_outputs, register_slot
from bridge_util import tiny_causal_lm

KIND, STEP, BUF = "toy_scale", "toy_scale_step", "toy_scale"
SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))

pytestmark = pytest.mark.usefixtures("one_thread")


def _fits(value, tensor, *, path, plan):
    if path not in plan.specs or tensor is None or tensor.dim() != 2 or value.shape != tensor.shape[:1]:
        raise ValueError(f"{path}: a toy scale of {tuple(value.shape)} does not fit its weight")


def _step(params, plan, *, context, bad=False):
    scales = {p: params[p].abs().amax(1) for p in plan.specs if params[p].dim() == 2}
    if bad:
        scales = {p: s[:-1] for p, s in scales.items()}
    return qt.Fit(toy_scale=scales)


def _attach(model, values):
    for path, s in values.items():
        m = model.get_submodule(path.rpartition(".")[0])
        if not isinstance(m, QLinear) or s.shape != (m.out_features,):
            raise ValueError(f"{path}: a toy scale goes on a quantized linear's rows")
    for path, s in values.items():
        model.get_submodule(path.rpartition(".")[0]).register_buffer(BUF, s)


def _read(model):
    return {f"{n}.weight": m._buffers[BUF] for n, m in model.named_modules() if m._buffers.get(BUF) is not None}


def _check_record(raw, entries):
    if not isinstance(raw, dict) or any(f"{m}.weight" not in entries for m in raw):
        raise ValueError(f"'{KIND}' must name quantized modules, got {raw!r}")
    return dict(raw)


def _abstract(model, record):
    for module, n in record.items():
        model.get_submodule(module).register_buffer(BUF, torch.empty(n, device="meta"))


@pytest.fixture
def toy_kind():
    """The kind, its slot and its step registered for one test, unregistered afterwards."""
    qt.register_output_kind(KIND, torch.Tensor, check=_fits, stale_after=("params",))
    register_slot(OutputSlot(
        name=KIND, label="toy scales", attach=_attach, read=_read,
        record=lambda values: {p.rpartition(".")[0]: int(s.numel()) for p, s in values.items()},
        check_record=_check_record,
        tensors=lambda values: {f"{p.rpartition('.')[0]}.{BUF}": s for p, s in values.items()},
        parts=lambda like, record, entries: {f"{m}.{BUF}": ((n,), torch.float32) for m, n in record.items()},
        take=lambda tree, record: {f"{m}.weight": tree.pop(f"{m}.{BUF}") for m in record},
        describe=lambda module, n: f"a toy scale ({n} rows)", summary=lambda record: f"toy scales: {len(record)}",
        abstract=_abstract))
    qt.register_algorithm(STEP, _step, outputs=(KIND,))
    try:
        yield
    finally:
        qt.ALGORITHMS.unregister(STEP)
        SLOTS.unregister(KIND)
        qt.OUTPUT_KINDS.unregister(KIND)


def _model(seed=0):
    torch.manual_seed(seed)
    return tiny_causal_lm("llama").eval()


def _same(got, want):
    assert sorted(got) == sorted(want) and want
    assert all(torch.equal(got[p], want[p]) for p in want)


def test_a_new_kind_goes_end_to_end(toy_kind, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model()
    recipe = qt.Recipe(default=SPEC, exclude=["lm_head*", "*embed*"], steps=[qt.Step(STEP), qt.Step("rtn")])
    result = bridge.quantize_params(model, recipe)
    want = result.outputs[KIND]  # rtn refits the weights' qparams: toy scales go stale on params only, kept
    weights = {p for p, v in result.qtree.items() if isinstance(v, qt.QTensor) and len(v.shape) == 2}
    assert set(want) == weights and all(torch.equal(s, model.state_dict()[p].abs().amax(1)) for p, s in want.items())

    q = bridge.to_module(model, result)
    _same(read_outputs(q)[KIND], want)
    bridge.save(q, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    assert cfg["version"] == 5 and cfg[KIND] == {p.rpartition(".")[0]: int(s.numel()) for p, s in want.items()}
    _same(read_outputs(bridge.load(tmp_path / "ck", like=_model(seed=3)))[KIND], want)
    _same(read_outputs(AutoModelForCausalLM.from_pretrained(tmp_path / "ck"))[KIND], want)
    bridge.save(result, tmp_path / "tree")  # the pipeline's result saved as a tree carries them too
    _same(read_outputs(bridge.load(tmp_path / "tree", like=_model(seed=3)))[KIND], want)

    from bridge.interop import export  # an exporter that does not hold the kind refuses it by path
    module = next(iter(cfg[KIND]))
    with pytest.raises(ValueError, match=rf"{module.replace('.', r'[.]')}: a toy scale \(\d+ rows\), which quark cannot"):
        export(tmp_path / "ck", to="quark", out=tmp_path / "out")
    from bridge.hf.dequantize import dequantize_model  # no fold: a float model cannot run it
    with pytest.raises(ValueError, match=r"carries toy scales \('toy_scale'\), which do not fold"):
        dequantize_model(q)


def test_the_kind_is_checked_and_refused_where_it_cannot_go(toy_kind):
    model = _model()
    with pytest.raises(ValueError, match=r"recipe\.steps\[0\] \(toy_scale_step\): .*weight: a toy scale of"):
        bridge.quantize_params(model, qt.Recipe(default=SPEC, steps=[qt.Step(STEP, bad=True)]))
    with pytest.raises(TypeError, match=r"Fit\.toy_scale\['w'\] must be a Tensor"):
        qt.Fit(toy_scale={"w": 1.0})
    from bridge.stream.accept import CannotStream, plan_streamed
    with pytest.raises(CannotStream, match=r"\(toy_scale_step\): toy scales are not written by a streamed run"):
        plan_streamed(model, qt.Recipe(default=SPEC, steps=[qt.Step(STEP)]), calibrated=False)
    # a step returning a kind it did not declare is refused by name
    qt.register_algorithm("toy_undeclared", _step)
    try:
        with pytest.raises(ValueError, match=r"returned 'toy_scale' outputs, which the step does not declare"):
            qt.run_steps({"fc.weight": torch.randn(8, 32)}, qt.Recipe(default=SPEC, steps=[qt.Step("toy_undeclared")]))
    finally:
        qt.ALGORITHMS.unregister("toy_undeclared")


def test_kinds_are_registered_once_and_named():
    with pytest.raises(ValueError, match="register_slot: 'nope' is not a kind of step output declared"):
        register_slot(OutputSlot(name="nope", label="", attach=None, read=None, record=None, check_record=None,
                                 tensors=None, parts=None, take=None, describe=None, summary=None))
    with pytest.raises(ValueError, match="name must be an identifier other than"):
        qt.register_output_kind("params", torch.Tensor)
    with pytest.raises(TypeError, match="unexpected keyword 'nope'"):
        qt.Fit(nope={})
    assert "lowrank" in qt.OUTPUT_KINDS and "lowrank" in SLOTS
