"""QuantSpec: defaults resolve, JSON round-trips, contradictions are rejected with clear messages."""

import json

import pytest

import qtransform as qt


def test_defaults_resolve_to_the_format():
    nf4 = qt.QuantSpec(format="nf4")
    assert nf4.granularity == qt.PerGroup(64) and nf4.scale_dtype == "float32"
    int4 = qt.QuantSpec(format="int4")
    assert int4.granularity == qt.PerTensor() and int4.symmetric_range == "full"
    asym = qt.QuantSpec(format="uint4", symmetric=False)
    assert asym.zero_point_domain == "int" and asym.symmetric_range is None
    assert qt.QuantSpec(format="int8", scale_dtype="e8m0").power_of_two is True


def test_equal_meaning_means_equal_and_same_hash():
    a = qt.QuantSpec(format="int4", granularity=qt.PerTensor(), symmetric_range="full")
    b = qt.QuantSpec(format="int4")
    assert a == b and hash(a) == hash(b)


def test_json_round_trip_and_unknown_fields():
    spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(64, axis=0), symmetric=False,
                        zero_point_domain="float", scale_dtype="float16")
    assert qt.QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="unknown field"):
        qt.QuantSpec.from_dict({"format": "int4", "bitz": 4})
    with pytest.raises(ValueError, match="granularity"):
        qt.QuantSpec.from_dict({"format": "int4", "granularity": {"type": "PerRow"}})


@pytest.mark.parametrize("kwargs, match", [
    ({"format": "int9"}, "unknown format 'int9'"),
    ({"format": "int4", "zero_point_domain": "float"}, "contradicts symmetric=True"),
    ({"format": "nf4", "symmetric": False}, "symmetric only"),
    ({"format": "int4", "symmetric": False, "symmetric_range": "full"}, "symmetric specs only"),
    ({"format": "nf4", "symmetric_range": "full"}, "integer formats"),
    ({"format": "int1"}, "int1 cannot hold a symmetric range"),
    ({"format": "int8", "scale_rule": "floor"}, "power-of-two"),
    ({"format": "int8", "power_of_two": True, "scale_rule": "nearest"}, "scale_rule"),
    ({"format": "int8", "rounding": "up"}, "rounding"),
    ({"format": "int8", "observer": "mse"}, "observer"),
    ({"format": "int8", "saturate": False}, "always saturates"),
    ({"format": "int8", "scale_dtype": "float64"}, "scale_dtype"),
    ({"format": "nf4", "scale_dtype": "e8m0"}, "does not allow"),
    ({"format": "int8", "symmetric": False, "zero_point_domain": "float", "power_of_two": True}, "float zero"),
    ({"format": "int8", "symmetric": "yes"}, "bool"),
    ({"format": "int8", "granularity": "per_tensor"}, "granularity"),
])
def test_contradictions_are_rejected(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        qt.QuantSpec(**kwargs)


def test_granularity_validation():
    with pytest.raises(ValueError, match="size"):
        qt.PerGroup(0)
    with pytest.raises(ValueError, match="PerBlock"):
        qt.PerBlock(())
    with pytest.raises(TypeError, match="axis"):
        qt.PerChannel("0")
