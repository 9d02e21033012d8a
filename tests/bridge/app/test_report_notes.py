"""The report's lines on what was not quantized the way the recipe's steps quantize (issue 51): every reason the
plan keeps tensors in float, and the tensors a calibrated recipe left to round to nearest."""

import torch

import bridge
import qtransform as qt
from bridge.app.record import kept_notes, nearest_notes
from bridge_util import tiny_causal_lm

GPTQ = qt.get_preset("gptq4-g64").recipe


def test_a_head_outside_the_blocks_is_said_to_be_rounded_to_nearest():
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    recipe = qt.Recipe(type_rules={"Linear": GPTQ.type_rules[0][1]}, steps=GPTQ.steps)  # the head too
    result = bridge.quantize_params(model, recipe, calibration=[torch.randint(0, 128, (1, 16))])
    assert nearest_notes(result) == ["round to nearest: 1 quantized tensor(s) no calibrated step fitted "
                                     "(e.g. lm_head.weight): outside the blocks the recipe's steps calibrate"]
    plain = bridge.quantize_params(model, qt.Recipe(type_rules={"Linear": GPTQ.type_rules[0][1]}))
    assert nearest_notes(plain) == []  # no calibrated step: round to nearest is the recipe


def test_every_reason_to_keep_a_tensor_is_a_line():
    torch.manual_seed(0)
    model = tiny_causal_lm("qwen2").eval()  # its attention biases: kept, ndim 1
    plan = bridge.plan(model, GPTQ)
    reasons = {m.rule for m in plan.values() if m.spec is None and m.rule.startswith("skipped (")}
    notes = kept_notes(plan)
    assert reasons and len(notes) == len(reasons)
    counts = {r: sum(1 for m in plan.values() if m.rule == r) for r in reasons}
    for r, n in counts.items():
        assert any(note.startswith(f"kept in float: {n} tensor(s)") and note.endswith(r[len("skipped ("):-1])
                   for note in notes), r
