"""Bad input gets a clear ValueError/TypeError naming the argument, value or shape, and tree path."""

import pytest
import torch

import qtransform as qt

SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))


@pytest.mark.parametrize("bad, kind, match", [
    (torch.tensor([[1.0, float("nan")] * 16]), ValueError, r"16 non-finite value\(s\) \(first nan at index \(0, 1\)\)"),
    (torch.tensor([[float("inf")] * 32]), ValueError, "32 non-finite"),
    (torch.zeros(0, 32), ValueError, r"empty \(shape \(0, 32\)\)"),
    (torch.ones(2, 32, dtype=torch.int32), TypeError, "torch.int32"),
    (torch.ones(2, 32, dtype=torch.complex64), TypeError, "complex64"),
    (torch.tensor(1.0), ValueError, "0-d"),
    ([[1.0] * 32], TypeError, "list"),
    (torch.ones(4, 1000), ValueError, r"group size 32 does not divide axis -1 of size 1000"),
])
def test_bad_tensors(bad, kind, match):
    with pytest.raises(kind, match=match):
        qt.choose_qparams(bad, SPEC)


def test_quantize_checks_values_and_shapes():
    x = torch.randn(4, 64)
    qp = qt.choose_qparams(x, SPEC)
    with pytest.raises(ValueError, match="non-finite"):
        qt.quantize(x.clone().index_fill_(1, torch.tensor([3]), float("nan")), qp)
    with pytest.raises(ValueError, match=r"grid \(4, 2\) does not match x of shape \(4, 96\)"):
        qt.quantize(torch.randn(4, 96), qp)
    with pytest.raises(TypeError, match="QParams"):
        qt.quantize(x, {"scale": qp.scale})


def test_padding_is_opt_in():
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), pad=True)
    x = torch.randn(3, 50)
    qp = qt.choose_qparams(x, spec)
    assert qp.scale.shape == (3, 2)
    y = qt.dequantize(qt.quantize(x, qp))
    assert y.shape == x.shape
    # padding repeats the last element, so the last group's range is that of its real values
    torch.testing.assert_close(qp.scale[:, 1], x[:, 32:].abs().amax(1) / 7.5)


def test_axis_out_of_range():
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        qt.choose_qparams(torch.randn(4, 8), qt.QuantSpec(format="int8", granularity=qt.PerChannel(2)))


def test_errors_name_the_tree_path():
    params = {"model.layers.3.mlp.up_proj.weight": torch.randn(8, 1000)}
    spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128))
    with pytest.raises(ValueError, match=r"^model\.layers\.3\.mlp\.up_proj\.weight: group size 128 does not divide axis -1 of size 1000"):
        qt.quantize_tree(params, spec)
    params = {"a.weight": torch.full((4, 128), float("inf"))}
    with pytest.raises(ValueError, match=r"^a\.weight: x of shape \(4, 128\) holds 512 non-finite"):
        qt.quantize_tree(params, spec)


def test_merge_and_compute_reject_mismatches():
    a = qt.observe(qt.init_stats(SPEC), torch.randn(2, 64))
    b = qt.observe(qt.init_stats(SPEC), torch.randn(3, 64))
    with pytest.raises(ValueError, match="grids differ"):
        qt.merge_stats(a, b)
    with pytest.raises(ValueError, match="no data observed"):
        qt.compute_qparams(qt.init_stats(SPEC))
    with pytest.raises(ValueError, match="gathered on another grid"):
        qt.compute_qparams(a, qt.QuantSpec(format="int4", granularity=qt.PerGroup(16)))
    with pytest.raises(ValueError, match="pad=False.*pad=True"):  # same granularity, padded grid
        qt.compute_qparams(a, qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), pad=True))
    mx = qt.observe(qt.init_stats(qt.QuantSpec(format="mx6")), torch.randn(2, 64))
    with pytest.raises(ValueError, match="sub-block 2"):  # micro-exponent statistics per sub-block
        qt.compute_qparams(mx, qt.QuantSpec(format="nvfp4"))
    other = qt.QuantSpec(format="int8", granularity=qt.PerGroup(32))
    with pytest.raises(ValueError, match="different specs"):
        qt.merge_stats(a, qt.observe(qt.init_stats(other), torch.randn(2, 64)))


def test_scale_overflow_in_a_narrow_scale_dtype():
    spec = qt.QuantSpec(format="int8", scale_dtype="float16")
    with pytest.raises(ValueError, match="overflows scale_dtype='float16'"):
        qt.choose_qparams(torch.tensor([1e8, -1.0]), spec)


def test_packing_rejects_bad_arguments():
    c = torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits"):
        qt.pack(c, 9)
    with pytest.raises(TypeError, match="integer"):
        qt.pack(c.float(), 4)
    with pytest.raises(ValueError, match="awq"):
        qt.pack(c, 4, order="awq")
    with pytest.raises(ValueError, match="need 4"):
        qt.unpack(torch.zeros(2, 3, dtype=torch.uint8), 4, 8)
