"""bits_per_element: the nominal figure of every format, and the exact figure against the bytes a
QTensor holds, for every registered format, several granularities and awkward shapes."""

from __future__ import annotations

import pytest
import torch

import qtransform as qt

NOMINAL = {
    "fp8_e4m3": 8.0, "fp8_e5m2": 8.0, "fp8_e4m3fnuz": 8.0, "fp8_e5m2fnuz": 8.0, "fp6_e3m2": 6.0,
    "fp6_e2m3": 6.0, "fp4_e2m1": 4.0, "bf16": 16.0, "fp16": 16.0,
    "mxfp8_e4m3": 8.25, "mxfp8_e5m2": 8.25, "mxfp6_e3m2": 6.25, "mxfp6_e2m3": 6.25, "mxfp4": 4.25,
    "mxint8": 8.25, "mx9": 9.0, "mx6": 6.0, "mx4": 4.0, "bfp16": 9.0, "nvfp4": 4.5,
}


@pytest.mark.parametrize("name, bits", sorted(NOMINAL.items()))
def test_nominal_bits(name, bits):
    assert qt.bits_per_element(qt.QuantSpec(format=name)) == bits


def test_nominal_bits_of_grouped_integer_specs():
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128), symmetric=False)
    assert qt.bits_per_element(spec) == 4 + (32 + 8) / 128
    fp8_blocks = qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerBlock((128, 128)))
    assert qt.bits_per_element(fp8_blocks) == 8 + 32 / 128 ** 2


def _specs(name):
    fmt = qt.FORMATS[name]
    if fmt.block is not None:
        return [qt.QuantSpec(format=name), qt.QuantSpec(format=name, granularity=qt.PerGroup(fmt.block, axis=0))]
    if fmt.family == "int" and fmt.codec.bits == 1:  # int1, uint1: asymmetric only
        return [qt.QuantSpec(format=name, symmetric=False, granularity=qt.PerGroup(16), pad=True)]
    specs = [qt.QuantSpec(format=name, pad=True), qt.QuantSpec(format=name, granularity=qt.PerChannel(0)),
             qt.QuantSpec(format=name, granularity=qt.PerGroup(16), pad=True),
             qt.QuantSpec(format=name, granularity=qt.PerBlock((4, 8)), pad=True)]
    if not fmt.symmetric_only:
        specs.append(qt.QuantSpec(format=name, symmetric=False, granularity=qt.PerGroup(16), pad=True))
    return specs


@pytest.mark.parametrize("name", sorted(qt.FORMATS))
def test_reported_bits_match_bytes_held(name):
    gen = torch.Generator().manual_seed(0)
    for spec in _specs(name):
        for shape in [(3, 7), (5, 64), (33, 40), (2, 3, 50)]:
            x = torch.randn(shape, generator=gen)
            q = qt.quantize(x, qt.choose_qparams(x, spec))
            held = 8.0 * q.nbytes() / x.numel()
            assert qt.bits_per_element(spec, shape) == held, (spec, shape)


def test_bad_arguments():
    with pytest.raises(TypeError, match="spec must be a QuantSpec"):
        qt.bits_per_element("mxfp4")
    with pytest.raises(ValueError, match="shape must be a non-empty tuple of positive sizes"):
        qt.bits_per_element(qt.QuantSpec(format="mxfp4"), (4, 0))
