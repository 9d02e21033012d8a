"""``transposed_qparams``: parameters fitted on the logical (out, in) layout decode the stored (in, out) tensor to
the transpose of what they decode, for every kind of scale; micro-exponent formats are refused by path."""

import pytest
import torch

import qtransform as qt

SPECS = [qt.QuantSpec(format="uint4", granularity=qt.PerGroup(16), symmetric=False),
         qt.QuantSpec(format="int8", granularity=qt.PerChannel(0)),
         qt.QuantSpec(format="nf4", granularity=qt.PerGroup(16)),
         qt.QuantSpec(format="mxfp4"),
         qt.QuantSpec(format="nvfp4"),
         qt.QuantSpec(format="fp8_e4m3")]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_the_stored_layout_decodes_to_the_transpose(spec):
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    spec = qt.choose_qparams(w, spec).spec  # the spec as the format completes it
    qp = qt.choose_qparams(w, spec)
    stored = qt.transposed_spec(spec, tuple(w.shape))
    moved = qt.transposed_qparams(qp, stored, path="h.0.mlp.c_fc.weight")
    assert moved.spec == stored
    want = qt.dequantize(qt.quantize(w, qp)).T
    got = qt.dequantize(qt.quantize(w.T.contiguous(), moved))
    assert torch.equal(got, want)


def test_a_micro_exponent_format_is_refused_by_path():
    spec = qt.QuantSpec(format="mx6")
    w = torch.randn(8, 32)
    qp = qt.choose_qparams(w, spec)
    with pytest.raises(ValueError, match="h.0.mlp.c_fc.weight.*mx6"):
        qt.transposed_qparams(qp, qt.transposed_spec(qp.spec, (8, 32)), path="h.0.mlp.c_fc.weight")
