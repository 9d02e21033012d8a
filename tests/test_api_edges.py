"""The edges of the pure core's API (issue 15): bad arguments get a TypeError/ValueError naming the
argument (and the path), and data at the float32 limits quantizes to finite values or a clear error.

Expected values are written out from the definitions (scales, grids, float32 constants), not taken
from the functions under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qtransform as qt
from qtransform.algorithms import hqq
from qtransform.pipeline import from_hqq_config, recipe_from_dict

F32_MAX = 3.4028234663852886e38  # (2 - 2^-23) * 2^127
SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))


def _q(x=None, spec=SPEC):
    x = torch.linspace(-1, 1, 4 * 64).reshape(4, 64) if x is None else x
    return qt.quantize(x, qt.choose_qparams(x, spec))


# ----------------------------------------------------------------------------- dequantize(dtype=)
@pytest.mark.parametrize("dtype, kind, match", [
    (torch.int32, TypeError, r"dequantize: dtype must be a floating-point torch.dtype .*got torch.int32"),
    (torch.bool, TypeError, "got torch.bool"),
    (torch.complex64, TypeError, "got torch.complex64"),
    ("float16", TypeError, r"dequantize: dtype must be a torch.dtype .*got str 'float16'"),
    (np.float32, TypeError, "dequantize: dtype must be a torch.dtype"),
])
def test_dequantize_dtype_must_be_a_floating_torch_dtype(dtype, kind, match):
    q = _q()
    with pytest.raises(kind, match=match):
        qt.dequantize(q, dtype=dtype)
    with pytest.raises(kind, match=match.replace("dequantize:", "dequantize_tree:")):
        qt.dequantize_tree({"w": q, "b": torch.ones(3)}, dtype=dtype)


def test_dequantize_to_a_floating_dtype():
    q = _q()
    assert qt.dequantize(q, dtype=torch.float16).dtype == torch.float16
    assert qt.dequantize(q).dtype == torch.float32
    assert qt.dequantize_tree({"w": q}, dtype=torch.bfloat16)["w"].dtype == torch.bfloat16


# ----------------------------------------------------------------------------- QTensor / QParams
def test_qtensor_checks_its_parts():
    q = _q()  # (4, 64) int4 g32: packed codes (4, 32) uint8, scale grid (4, 2)
    ok = dict(codes=q.codes, qparams=q.qparams, width=64, dtype=torch.float32)
    bad_scale = qt.QParams(scale=torch.ones(3, 3), spec=SPEC)
    with pytest.raises(ValueError, match=r"QTensor: qparams.scale has shape \(3, 3\), but codes of logical shape "
                                         r"\(4, 64\) under int4 g32 sym need the grid \(4, 2\)"):
        qt.QTensor(**{**ok, "qparams": bad_scale})
    with pytest.raises(ValueError, match=r"qparams.scale has shape \(4, 1\)"):
        qt.QTensor(**{**ok, "qparams": qt.QParams(scale=torch.ones(4, 1), spec=SPEC)})
    asym = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False)
    qa = _q(spec=asym)
    zp = qt.QParams(scale=qa.qparams.scale, zero_point=qa.qparams.zero_point[:, :1], spec=asym)
    with pytest.raises(ValueError, match=r"qparams.zero_point has shape \(4, 1\)"):
        qt.QTensor(codes=qa.codes, qparams=zp, width=64, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"codes of shape \(4, 32\) do not fit width=60: .* 30 bytes"):
        qt.QTensor(**{**ok, "width": 60})
    with pytest.raises(TypeError, match="codes of int4 are stored as torch.uint8, got torch.int32"):
        qt.QTensor(**{**ok, "codes": q.codes.to(torch.int32)})
    with pytest.raises(TypeError, match="QTensor: codes must be a torch.Tensor, got list"):
        qt.QTensor(**{**ok, "codes": [1, 2]})
    with pytest.raises(TypeError, match="QTensor: qparams must be a QParams, got dict"):
        qt.QTensor(**{**ok, "qparams": {"scale": q.qparams.scale}})
    with pytest.raises(ValueError, match="QTensor: width .* must be a positive int, got 0"):
        qt.QTensor(**{**ok, "width": 0})
    with pytest.raises(TypeError, match="QTensor: dtype must be a floating-point torch.dtype"):
        qt.QTensor(**{**ok, "dtype": torch.int8})
    with pytest.raises(ValueError, match="group size 32 does not divide axis -1 of size 48"):
        qt.QTensor(codes=torch.zeros(4, 24, dtype=torch.uint8), qparams=qt.QParams(scale=torch.ones(4, 2), spec=SPEC),
                   width=48, dtype=torch.float32)
    assert torch.equal(qt.dequantize(qt.QTensor(**ok)), qt.dequantize(q))


def test_qparams_fields_are_tensors():
    with pytest.raises(TypeError, match="QParams: scale must be a torch.Tensor, got float"):
        qt.QParams(scale=1.0, spec=SPEC)
    with pytest.raises(TypeError, match="QParams: zero_point must be a torch.Tensor or None, got int"):
        qt.QParams(scale=torch.ones(1), zero_point=0, spec=SPEC)
    with pytest.raises(TypeError, match="QParams: spec must be a QuantSpec, got str"):
        qt.QParams(scale=torch.ones(1), spec="int4")


def test_pytree_transforms_still_rebuild_qtensors():
    q = _q()
    doubled = torch.utils._pytree.tree_map(lambda t: t, q)
    assert isinstance(doubled, qt.QTensor) and torch.equal(qt.dequantize(doubled), qt.dequantize(q))
    batched = torch.func.vmap(lambda t: qt.quantize(t, qt.choose_qparams(t, SPEC)))(torch.randn(3, 4, 64))
    assert batched.codes.shape == (3, 4, 32)


# ----------------------------------------------------------------------------- Recipe and recipe dicts
@pytest.mark.parametrize("exclude, match", [
    (5, r"Recipe.exclude must be a glob string or a list of them, got 5"),
    ({"lm_head*": 1}, r"Recipe.exclude must be a glob string or a list of them"),
    (b"lm_head*", r"Recipe.exclude must be a glob string or a list of them"),
    (["ok*", None], r"Recipe.exclude must hold glob strings, got None"),
])
def test_recipe_exclude(exclude, match):
    with pytest.raises(TypeError, match=match):
        qt.Recipe(exclude=exclude)


def test_recipe_exclude_forms_that_work():
    assert qt.Recipe(exclude="lm_head*").exclude == ("lm_head*",)
    assert qt.Recipe(exclude=("a*", "b*")).exclude == ("a*", "b*")


@pytest.mark.parametrize("d, kind, match", [
    (None, TypeError, "Recipe.from_dict expects a dict, got NoneType"),
    ({"rules": 5}, TypeError, r"Recipe.from_dict: rules must be a list of \[glob, spec\] pairs"),
    ({"type_rules": "Linear"}, TypeError, r"Recipe.from_dict: type_rules must be a list"),
    ({"rules": [["*.w"]]}, TypeError, r"Recipe.from_dict: rules\[0\] must be a \[glob, spec\] pair, got \['\*.w'\]"),
    ({"rules": [[5, None]]}, TypeError, r"Recipe.from_dict: rules\[0\]: the glob must be a string, got 5"),
    ({"rules": [["*.w", 5]]}, TypeError, r"Recipe.from_dict: rules\['\*.w'\] must be a spec dict"),
    ({"rules": {"*.w": {"format": "int4", "bogus": 1}}}, ValueError,
     r"Recipe.from_dict: rules\['\*.w'\]: QuantSpec.from_dict: unknown field\(s\) \['bogus'\]"),
    ({"default": 5}, TypeError, "Recipe.from_dict: default must be a spec dict"),
    ({"default": {"format": "int99"}}, ValueError, "Recipe.from_dict: default: unknown format 'int99'"),
    ({"exclude": 5}, TypeError, "Recipe.from_dict: Recipe.exclude must be a glob string"),
    ({"min_ndim": "2"}, ValueError, "Recipe.from_dict: Recipe.min_ndim must be a positive int, got '2'"),
    ({"steps": 5}, TypeError, "Recipe.from_dict: Recipe.steps must be a list of steps, got int"),
    ({"steps": ["rtn", 5]}, TypeError, r"Recipe.from_dict: Recipe.steps\[1\]: expected an algorithm name"),
    ({"rulez": {}}, ValueError, r"Recipe.from_dict: unknown field\(s\) \['rulez'\]"),
])
def test_recipe_from_dict_names_the_field(d, kind, match):
    with pytest.raises(kind, match=match):
        qt.Recipe.from_dict(d)


def test_recipe_dict_round_trip_still_works():
    r = qt.Recipe(default=SPEC, rules={"*.down.weight": qt.QuantSpec(format="int8"), "*.skip.weight": None},
                  type_rules={"Linear": SPEC}, exclude=["lm_head*"], steps=["rtn"])
    assert qt.Recipe.from_dict(r.to_dict()) == r
    assert qt.Recipe.from_dict({"rules": {"*.w": None}}).rules == (("*.w", None),)


@pytest.mark.parametrize("d, kind, match", [
    ({"nbits": "4"}, TypeError, r"recipe.nbits must be an int in 1..8, got '4'"),
    ({"nbits": 9}, ValueError, r"recipe.nbits must be an int in 1..8, got 9"),
    ({"nbits": True}, TypeError, r"recipe.nbits must be an int in 1..8, got True"),
    ({"nbits": 4.5}, TypeError, r"recipe.nbits must be an int in 1..8, got 4.5"),
    ({"nbits": 4, "group_size": 0}, ValueError, r"recipe.group_size must be a positive int or null, got 0"),
    ({"nbits": 4, "group_size": "64"}, TypeError, r"recipe.group_size must be a positive int or null"),
    ({"nbits": 4, "axis": 2}, ValueError, r"recipe.axis must be 0 or 1, got 2"),
    ({"nbits": 4, "skip_modules": "lm_head"}, TypeError, r"recipe.skip_modules must be a list of module names"),
    ({"nbits": 4, "skip_modules": 5}, TypeError, r"recipe.skip_modules must be a list of module names"),
    ({"dynamic_config": 5}, TypeError, r"recipe.dynamic_config must be a dict of module tag"),
    ({"dynamic_config": {"mlp.up_proj": {"nbits": "x"}}}, TypeError,
     r"recipe.dynamic_config\['mlp.up_proj'\].nbits must be an int in 1..8, got 'x'"),
    ({"dynamic_config": {"mlp.up_proj": 4}}, TypeError, r"recipe.dynamic_config\['mlp.up_proj'\] must be a dict"),
    ({"exclude": 5}, TypeError, r"recipe.exclude must be a glob string or a list of them, got 5"),
    ({"min_ndim": 0}, ValueError, r"recipe.min_ndim must be a positive int, got 0"),
    ({"rules": {"*.w": "no-such-preset"}}, ValueError, r"recipe.rules\['\*.w'\]: unknown recipe 'no-such-preset'"),
    ({"rules": {"*.w": 5}}, TypeError, r"recipe.rules\['\*.w'\]: expected a spec dict"),
])
def test_recipe_files_name_the_key(d, kind, match):
    with pytest.raises(kind, match=match):
        recipe_from_dict(d)


def test_from_hqq_config_checks_its_arguments():
    with pytest.raises(TypeError, match="skip_modules must be a list of module names"):
        from_hqq_config(skip_modules="lm_head")
    with pytest.raises(ValueError, match="nbits must be an int in 1..8, got 0"):
        from_hqq_config(nbits=0)
    r = from_hqq_config(nbits=3, group_size=None, skip_modules=["lm_head"])
    assert r.exclude == ("lm_head*",) and all(s.format == "uint3" for _, s in r.type_rules)


# ----------------------------------------------------------------------------- trees
@pytest.mark.parametrize("params, match", [
    ({"fc.weight": np.ones((4, 64), np.float32)}, r"params\['fc.weight'\] is not a torch.Tensor \(got numpy.ndarray\)"
                                                  r".*torch.from_numpy"),
    ({"fc.weight": [[1.0] * 64] * 4}, r"params\['fc.weight.0.0'\] is not a torch.Tensor \(got float\)"),
    ({"fc.weight": "w", "b": torch.ones(2, 32)}, r"params\['fc.weight'\] is not a torch.Tensor \(got str\)"),
    ({"fc.weight": torch.ones(4, 64), "fc.bias": None}, r"params\['fc.bias'\] is not a torch.Tensor \(got NoneType\)"),
    ({"step": 3}, r"params\['step'\] is not a torch.Tensor \(got int\)"),
    (None, r"params must be a tree of tensors .* got None"),
])
def test_trees_hold_tensors_only(params, match):
    for call in (lambda: qt.quantize_tree(params, SPEC), lambda: qt.run_steps(params, qt.Recipe(default=SPEC)),
                 lambda: qt.get_algorithm("rtn")(params, SPEC), lambda: hqq.fit_tree(params, SPEC)):
        with pytest.raises(TypeError, match=match):
            call()


def test_quantize_tree_qparams_and_types_arguments():
    params = {"fc.weight": torch.randn(4, 64)}
    qp = qt.choose_qparams(params["fc.weight"], SPEC)
    with pytest.raises(TypeError, match="quantize_tree: qparams must map tree paths to QParams, got list"):
        qt.quantize_tree(params, SPEC, qparams=[qp])
    with pytest.raises(TypeError, match="quantize_tree: qparams must be keyed by tree paths \\(str\\), got the key 0"):
        qt.quantize_tree(params, SPEC, qparams={0: qp})
    with pytest.raises(TypeError, match=r"quantize_tree: qparams\['fc.weight'\] must be a QParams, got Tensor"):
        qt.quantize_tree(params, SPEC, qparams={"fc.weight": qp.scale})
    with pytest.raises(TypeError, match="types must map tree paths to module type names, got list"):
        qt.quantize_tree(params, SPEC, types=["Linear"])
    with pytest.raises(TypeError, match="types must map tree paths to module type names, got str"):
        qt.quantize_tree(params, SPEC, types="Linear")
    with pytest.raises(TypeError, match=r"types must map tree paths \(str\) to module type names \(str\), "
                                        r"got 'fc.weight': 5"):
        qt.quantize_tree(params, SPEC, types={"fc.weight": 5})
    with pytest.raises(TypeError, match=r"got 0: 'Linear'"):
        qt.quantize_tree(params, SPEC, types={0: "Linear"})
    assert isinstance(qt.quantize_tree(params, SPEC, qparams={"fc.weight": qp})["fc.weight"], qt.QTensor)


# ----------------------------------------------------------------------------- uint1
@pytest.mark.parametrize("rng", ["full", "restricted"])
def test_one_bit_symmetric_is_refused(rng):
    for name in ("uint1", "int1"):
        with pytest.raises(ValueError, match=f"QuantSpec: {name} cannot hold a symmetric range.*symmetric=False"):
            qt.QuantSpec(format=name, symmetric_range=rng)


def test_uint1_asymmetric_is_two_levels():
    x = torch.tensor([[-1.0, -0.2, 0.4, 3.0]])
    spec = qt.QuantSpec(format="uint1", symmetric=False, zero_point_domain="float", granularity=qt.PerChannel(0))
    y = qt.dequantize(qt.quantize(x, qt.choose_qparams(x, spec)))
    # scale = (3 - -1) / 1 = 4, zero point 1/4: the two levels are -1 and 3; ties (1.0) round to even (code 0)
    assert y.tolist() == [[-1.0, -1.0, -1.0, 3.0]]


# ----------------------------------------------------------------------------- the float32 limits
def _every_spec():
    """Every registered format with every scale dtype and symmetry it accepts (one granularity)."""
    out = []
    for name, fmt in qt.FORMATS.items():
        gran = None if fmt.block is not None else qt.PerGroup(8)
        for scale_dtype in fmt.scale_dtypes:
            for kw in ({"symmetric": True}, {"symmetric": False, "zero_point_domain": "int"},
                       {"symmetric": False, "zero_point_domain": "float"}):
                try:
                    out.append(qt.QuantSpec(format=name, granularity=gran, scale_dtype=scale_dtype, **kw))
                except ValueError:
                    continue
    return out


EDGE = torch.tensor([[F32_MAX, -F32_MAX, 1.0, -2.5e38, 0.0, 1e-45, 1e30, -F32_MAX] * 4,
                     [F32_MAX, 3e38, 1e38, 0.5, 2e38, 1e-38, 3.3e38, F32_MAX] * 4])


@pytest.mark.parametrize("spec", _every_spec(), ids=str)
def test_values_at_the_float32_maximum_stay_finite_or_raise_clearly(spec):
    try:
        qp = qt.choose_qparams(EDGE, spec)
    except ValueError as e:
        msg = str(e)
        if spec.scale_dtype == "float32":
            assert "use float32" not in msg and "scale_dtype='float32'" not in msg, msg
        assert ("float32" in msg and ("largest float32" in msg or "float32's limit" in msg)) or (
            f"overflows scale_dtype={spec.scale_dtype!r}" in msg and "use scale_dtype='float32'" in msg), msg
        return
    y = qt.dequantize(qt.quantize(EDGE, qp))
    assert bool(torch.isfinite(y).all()), y
    assert torch.equal(qt.fake_quantize(EDGE, qp), y)
    g = torch.func.grad(lambda t: qt.fake_quantize(t, qp).sum())(EDGE)
    assert bool(torch.isfinite(g).all())
    err = (y.double() - EDGE.double()).abs()
    assert bool((err <= qt.error_bound(EDGE, qp).double() * (1 + 2 ** -12) + 1e-38).all())
    assert bool(torch.isfinite(torch.func.vmap(qt.dequantize)(torch.func.vmap(
        lambda t: qt.quantize(t, qt.choose_qparams(t, spec)))(torch.stack([EDGE, -EDGE])))).all())


@pytest.mark.parametrize("name, half", [("int2", 1.5), ("int3", 3.5), ("uint2", 1.5), ("uint3", 3.5)])
def test_small_symmetric_integers_at_the_maximum(name, half):
    """Full symmetric range: scale = F / half; +F lands on half (saturating to qmax = half - 0.5) and -F
    on -half, which rounds to the code qmin = -(half + 0.5): its value exceeds F and saturates to -F."""
    x = torch.tensor([[F32_MAX, -F32_MAX, 0.0, 1.0]])
    spec = qt.QuantSpec(format=name, granularity=qt.PerChannel(0))
    y = qt.dequantize(qt.quantize(x, qt.choose_qparams(x, spec)))
    scale = np.float32(F32_MAX) / np.float32(half)
    assert y[0, 0].item() == float(np.float32(half - 0.5) * scale)
    assert y[0, 1].item() == -F32_MAX
    assert y[0, 2:].tolist() == [0.0, 0.0]


def test_fp4_with_e8m0_scales_at_the_maximum():
    """amax = F: the ceil rule gives 2^ceil(log2(F / 6)) = 2^126; F / 2^126 rounds to the fp4 value 4,
    and 4 * 2^126 = 2^128 lies beyond float32: it saturates to F (the input itself)."""
    x = torch.tensor([[F32_MAX, -F32_MAX, 2.0 ** 126, 0.0]])
    spec = qt.QuantSpec(format="fp4_e2m1", granularity=qt.PerChannel(0), scale_dtype="e8m0")
    qp = qt.choose_qparams(x, spec)
    assert qp.scale.tolist() == [[126 + 127]]
    y = qt.dequantize(qt.quantize(x, qp))
    assert y.tolist() == [[F32_MAX, -F32_MAX, 2.0 ** 126, 0.0]]


def test_bfloat16_data_at_its_maximum():
    big = torch.finfo(torch.bfloat16).max
    x = torch.tensor([[big, -big, 1.0, 0.0] * 8], dtype=torch.bfloat16)
    for spec in (qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)),
                 qt.QuantSpec(format="int8", scale_dtype="bfloat16", symmetric_range="restricted")):
        y = qt.dequantize(qt.quantize(x, qt.choose_qparams(x, spec)))
        assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
        assert y[0, 1].item() == -big


def test_scale_overflow_messages():
    with pytest.raises(ValueError, match=r"overflows scale_dtype='float16' \(max 6.55e\+04\); use scale_dtype='float32'"):
        qt.choose_qparams(torch.tensor([1e8, -1.0]), qt.QuantSpec(format="int8", scale_dtype="float16"))
    x = torch.tensor([[F32_MAX, -F32_MAX]])
    uint1 = qt.QuantSpec(format="uint1", symmetric=False, granularity=qt.PerChannel(0))
    with pytest.raises(ValueError, match=r"^w: the block at grid index \(0, 0\) spans \[-3.403e\+38, 3.403e\+38\]: "
                                         r"its scale \(max - min\) / 1 exceeds the largest float32") as e:
        qt.choose_qparams(x, uint1, path="w")
    assert "use float32" not in str(e.value) and "scale_dtype='float32'" not in str(e.value)
    int2 = qt.QuantSpec(format="int2", granularity=qt.PerChannel(0), scale_dtype="e8m0")
    with pytest.raises(ValueError, match=r"needs the power-of-two scale 2\^128 .* beyond the largest power of two "
                                         r"e8m0 holds \(2\^127\)"):
        qt.choose_qparams(x, int2)


def test_saturate_false_keeps_the_formats_infinity():
    spec = qt.QuantSpec(format="fp8_e5m2", saturate=False)
    qp = qt.QParams(scale=torch.ones(1), spec=spec)
    assert qt.dequantize(qt.quantize(torch.tensor([1e6, 1.0]), qp)).tolist() == [float("inf"), 1.0]
