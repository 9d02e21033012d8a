"""Every step on CUDA against the same step on CPU, from the same weights and calibration data: a tiny Llama
(random weights, built from its config here), a few random-token batches, ``bridge.quantize_params`` with the
model on each device.

What equal means (see ``near_ties.py`` for the near-tie):

* RTN: every scale equal within 2 ulps (``amax`` exact, one correctly rounded division; CUDA may fuse a
  multiply-add that the CPU rounds twice), every code equal but at near-ties within ``1e-6`` (8 float32 ulps).
* HQQ: groups are independent; float32 group sums in another order move a group's ``(s, z)`` by ulps, and a
  code flipped at a tie moves its group's next zero point by ``1/64`` of a step: from there that group's
  iterates differ; a float16 scale or zero point (the preset stores them so) rounds ulps away except within
  ulps of a float16 rounding boundary, where it moves by one float16 ulp. So: at most 5% of the groups have
  parameters further apart than ``1e-6`` relative (a flip needs one of 64 values within ~1e-5 of a boundary,
  ~20 iterations: ~2.5% at most, plus ~1e-3 from the float16 rounding), and in the others every code is
  equal but at near-ties within ``1e-5``.
* Static activation scales (int8, fp8, the KV cache): the activations come through float32 matmuls of at most
  128 terms in another order (and attention): each rounding ``2**-24`` relative, ``128 * 2**-24 ≈ 8e-6`` per
  matmul for sums without cancellation, a few layers deep: the scales (``absmax / qmax``) within ``1e-4``.
* GPTQ (alone, after SmoothQuant, rotate or SpinQuant) and AWQ: a near-tie flipped in GPTQ's column loop
  changes that row's error feedback and so the rest of that row; an AWQ grid choice flips only where two
  candidates' errors are within float noise. A row diverges with probability ~ columns x 2 x 1e-5 (~0.3% for
  128 columns): at least 95% of the codes equal (a bound >10x that), and the quantized model's output error
  on CUDA at most 1.25x the CPU run's (the diverged rows are solved by the same greedy rule: their error is
  the same in distribution; 5% of the rows with twice the error would give 1.05x).

Each test runs in seconds on a GPU (two layers, width 64).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import bridge
import qtransform as qt
from bridge.app.placement import to_host

from bridge_util import tiny_causal_lm
from near_ties import element_params, equal_fraction, unexplained

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (make test-gpu on a GPU machine)")
CALIB = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(4)]
EVAL = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(99))


def _model(on_grid: qt.QuantSpec | None = None):
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    # plain matmuls for attention: CUDA's fused float32 attention kernels round differently (~2e-4 relative
    # measured on an H200), which is torch's precision, not the calibration's under test
    model.config._attn_implementation = "eager"
    if on_grid:
        with torch.no_grad():
            for name, m in model.named_modules():
                if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
                    m.weight.copy_(qt.dequantize(qt.quantize(m.weight, qt.choose_qparams(m.weight, on_grid))))
    return model


def run(recipe, device: str, *, calibrated: bool = True, on_grid: qt.QuantSpec | None = None):
    """``(model on the host, Quantized on the host)`` of ``recipe`` run with the model on ``device``.
    ``on_grid``: the linear weights replaced by their round trip through that spec first (a fixed point: the
    step's RTN then has no near-tie to flip)."""
    model = _model(on_grid).to(device)
    with torch.no_grad():
        result = bridge.quantize_params(model, recipe, calibration=CALIB if calibrated else None)
    return model.to("cpu"), to_host(result)


def _restricted(recipe):
    rules = tuple((t, dataclasses.replace(spec, symmetric_range="restricted")) for t, spec in recipe.type_rules)
    return dataclasses.replace(recipe, type_rules=rules)


def both(recipe, *, calibrated: bool = True, device: str = "cuda", on_grid: qt.QuantSpec | None = None):
    return (run(recipe, "cpu", calibrated=calibrated, on_grid=on_grid),
            run(recipe, device, calibrated=calibrated, on_grid=on_grid))


def quantized(result) -> dict:
    return {p: v for p, v in result.changed().items() if isinstance(v, qt.QTensor)}


def output_error(model, result) -> float:
    """Mean squared difference of the quantized model's logits from the float model's (on the host)."""
    with torch.no_grad():
        ref = model(EVAL).logits
        q = bridge.to_module(copy.deepcopy(model), result)
        return float((q(EVAL).logits - ref).pow(2).mean())


def check_rtn_like(cpu, gpu, *, rtol: float, diverged: float = 0.0):
    (_, a), (_, b) = cpu, gpu
    qa, qb = quantized(a), quantized(b)
    assert qa.keys() == qb.keys() and qa
    groups = bad_groups = 0
    for p, x in qa.items():
        y, w = qb[p], a.params[p]
        sa, sb = x.qparams.scale, y.qparams.scale
        close = torch.isclose(sa.float(), sb.float(), rtol=1e-6, atol=0)
        if x.qparams.zero_point is not None:
            close &= torch.isclose(x.qparams.zero_point.float(), y.qparams.zero_point.float(), rtol=1e-6, atol=1e-6)
        groups += close.numel()
        bad_groups += int((~close).sum())
        if not diverged:
            assert torch.allclose(sa.float(), sb.float(), rtol=2.0 ** -22, atol=0), p
        mask = unexplained(w, x, y, rtol=rtol)
        # elements of groups whose parameters diverged: excluded (bounded below), the rest must be near-ties
        (sx, zx), (sy, zy) = element_params(x), element_params(y)
        ok = torch.isclose(sx.cpu(), sy.cpu(), rtol=1e-6, atol=0) & torch.isclose(zx.cpu(), zy.cpu(), rtol=1e-6,
                                                                                 atol=1e-6)
        assert not bool((mask & ok).any()), f"{p}: {int((mask & ok).sum())} codes differ away from a near-tie"
    assert bad_groups <= diverged * groups, f"{bad_groups} of {groups} groups diverged"


@cuda
@pytest.mark.cuda
def test_rtn_on_cuda_equals_cpu_but_at_near_ties():
    check_rtn_like(*both(qt.get_preset("int4-g64-asym").recipe, calibrated=False), rtol=1e-6)


@cuda
@pytest.mark.cuda
def test_hqq_on_cuda_equals_cpu_but_at_near_ties_and_few_diverged_groups():
    check_rtn_like(*both(qt.get_preset("hqq4-g64").recipe, calibrated=False), rtol=1e-5, diverged=0.05)


def check_static_scales(cpu, gpu):
    (_, a), (_, b) = cpu, gpu
    assert a.activations.keys() == b.activations.keys()
    static = [s for s, v in a.activations.items() if isinstance(v, qt.QParams)]
    assert static, "no static activation scales were calibrated"
    for site in static:
        sa, sb = a.activations[site].scale.float(), b.activations[site].scale.float()
        rel = float(((sa - sb).abs() / sa.abs()).max())
        assert rel <= 1e-4, f"{site}: scales {sa.flatten().tolist()} (cpu) and {sb.flatten().tolist()} differ by {rel:.3g}"


@cuda
@pytest.mark.cuda
def test_static_int8_activation_scales_on_cuda_equal_cpu_within_float_noise():
    # weights already on the int8 grid: RTN gives the same codes on both devices (no near-tie to flip: a flipped
    # weight code moves the activations after it by a step, ~1e-3, far beyond float noise), so the scales see
    # the same model and differ only by the forward's float rounding
    # the weights' 'full' symmetric range (scale absmax / 127.5) puts every row's extreme at +-127.5, a tie:
    # the restricted range (absmax / 127) has its round trip as a fixed point, every weight an exact code
    recipe = _restricted(qt.get_preset("w8a8-int8").recipe)
    cpu, gpu = both(recipe, on_grid=recipe.type_rules[0][1])
    check_static_scales(cpu, gpu)
    check_rtn_like(cpu, gpu, rtol=1e-6)  # the weights: RTN int8 per channel


@cuda
@pytest.mark.cuda
def test_static_fp8_activation_and_kv_cache_scales_on_cuda_equal_cpu_within_float_noise():
    cpu, gpu = both(qt.get_preset("fp8-w8a8-kv").recipe)
    check_static_scales(cpu, gpu)
    assert any(s.role in ("key", "value") for s in cpu[1].activations), "no KV-cache site calibrated"


SEARCHED = ("awq_alpha", "smoothquant_alpha")  # the grid searches' choices (not losses, which differ by float noise)


def _choices(result, path: str) -> dict:
    return {k: v for k, v in result.info.get(path, {}).items() if k in SEARCHED}


def check_searched(cpu, gpu, *, equal: float = 0.95, factor: float = 1.25):
    """A search's choice (SmoothQuant's alpha per group, recorded in ``info``) flips where two candidates' losses
    are within float noise: such tensors are the search's near-ties, excluded from the codes compared (at most
    half of them: flat losses are the exception), and the output error bounds them all."""
    (model, a), (_, b) = cpu, gpu
    qa, qb = quantized(a), quantized(b)
    assert qa.keys() == qb.keys() and qa
    flipped = {p for p in qa if _choices(a, p) != _choices(b, p)}
    assert len(flipped) <= len(qa) // 2, f"the searches chose differently on {sorted(flipped)}"
    frac = equal_fraction({p: v for p, v in qa.items() if p not in flipped},
                          {p: v for p, v in qb.items() if p not in flipped})
    assert frac >= equal, f"only {frac:.4f} of the codes equal"
    ea, eb = output_error(model, a), output_error(model, b)
    assert eb <= factor * ea + 1e-12, (ea, eb)


def _with_steps(preset: str, *steps):
    return dataclasses.replace(qt.get_preset(preset).recipe, steps=tuple(steps))


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["gptq4-g64", "awq4-g64", "w8a8-int8-sq", "quarot-w4a8"])
def test_calibrated_step_on_cuda_matches_cpu(preset):
    check_searched(*both(qt.get_preset(preset).recipe))


@cuda
@pytest.mark.cuda
def test_spinquant_few_iterations_on_cuda_matches_cpu():
    recipe = _with_steps("spinquant-w4a8", qt.Step("spinquant", iters=3), qt.Step("gptq"))
    check_searched(*both(recipe))


def test_the_comparisons_hold_between_two_cpu_runs():
    """The machinery on CPU (CPU against CPU: everything equal)."""
    cpu = run(qt.get_preset("int4-g64-asym").recipe, "cpu", calibrated=False)
    check_rtn_like(cpu, cpu, rtol=0.0)
    check_searched(cpu, cpu, equal=1.0, factor=1.0)
    recipe = _restricted(qt.get_preset("w8a8-int8").recipe)
    a = run(recipe, "cpu", on_grid=recipe.type_rules[0][1])
    ties = [p for p, q in quantized(a[1]).items() if not torch.equal(a[1].params[p], qt.dequantize(q))]
    assert not ties, f"weights on the grid are not their own round trip: {ties}"
    check_static_scales(a, a)
    check_rtn_like(a, a, rtol=0.0)


TRAINED = [qt.Step("qat", init="gptq", iters=10, batch_size=2), qt.Step("qat", init="minmax", iters=10, batch_size=2),
           qt.Step("signround", iters=10, batch_size=2)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("step", TRAINED, ids=lambda s: f"{s.name}-{dict(s.options).get('init', 'default')}")
def test_trained_steps_on_the_device_lower_the_error_as_on_cpu(step, device):
    """Adam's or the signed steps' iterates on another device drift apart by float noise (and the choice of the
    trained or the start state may flip where they are within it): the codes are not compared, the output error
    is: at most 1.25x the CPU run's, and below round to nearest's on both. On CPU against CPU: the same bytes."""
    recipe = _with_steps("qat2-g64", step)
    cpu, other = both(recipe, device=device)
    model, rtn = run(_with_steps("qat2-g64"), "cpu", calibrated=False)
    ea, eb, e_rtn = output_error(*cpu), output_error(*other), output_error(model, rtn)
    assert ea < e_rtn and eb < e_rtn, (ea, eb, e_rtn)
    assert eb <= 1.25 * ea + 1e-12, (ea, eb)
    if device == "cpu":
        qa, qb = quantized(cpu[1]), quantized(other[1])
        assert qa.keys() == qb.keys() and all(torch.equal(qa[p].codes, qb[p].codes) for p in qa)
