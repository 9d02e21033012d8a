"""The compressed-tensors importer validates what it reads before it builds anything: damaged or edited exports of
our own are refused with one ``CheckpointError`` (or ``ValueError``/``TypeError``) naming the file and the tensor
or key, never loaded with other numbers (a packed tensor is never cut to fit an edited ``num_bits``) and never a
raw ``KeyError``/``AttributeError``/``ZeroDivisionError``."""


import pytest
import torch
from bridge_util import copy_export
from interop.compressed_tensors.helpers import FP8_CHANNEL, tiny

import bridge
import qtransform as qt
from bridge import interop
from bridge.checkpoint import CheckpointError
from bridge.interop.compressed_tensors.tensors import pack_int32, unpack_int32

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
RECIPES = {"fp8": qt.Recipe(type_rules={"Linear": FP8_CHANNEL}, exclude=["lm_head*"]),
           "int4": qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))},
                             exclude=["lm_head*"])}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root, out = tmp_path_factory.mktemp("ct-checks"), {}
    for name, recipe in RECIPES.items():
        bridge.save(bridge.quantize(tiny("llama"), recipe), root / f"{name}-ckpt")
        out[name] = interop.export(root / f"{name}-ckpt", to="compressed-tensors", out=root / name)
    return out


def _load(path, **kw):
    return bridge.load(path, like=tiny("llama"), **kw)


def _bare(meta):
    """Metadata as a third-party file has it: no digests, no qtransform specs."""
    return {"format": "pt"}


def test_unedited_exports_load_verified(exports):
    for path in exports.values():
        with torch.no_grad():
            assert torch.isfinite(_load(path)(IDS).logits).all()


def test_swapped_same_shape_tensors_are_refused_by_digest(exports, tmp_path):
    a, b = "model.layers.0.mlp.gate_proj.weight_packed", "model.layers.1.mlp.gate_proj.weight_packed"

    def swap(t):
        t[a], t[b] = t[b], t[a]
        return t
    bad = copy_export(exports["int4"], tmp_path / "swapped", tensors=swap)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*layers\.[01]\.mlp\.gate_proj\.weight_packed"):
        _load(bad)
    _load(bad, verify=False)  # the switch skips the digests


@pytest.mark.parametrize("meta", [None, _bare])
def test_fp8_weight_without_its_scale_is_refused(exports, tmp_path, meta):
    name = "model.layers.0.mlp.up_proj.weight_scale"
    bad = copy_export(exports["fp8"], tmp_path / "noscale", metadata=meta,
                tensors=lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        _load(bad)


def test_packed_weight_without_its_scale_is_refused(exports, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    bad = copy_export(exports["int4"], tmp_path / "noscale", metadata=_bare,
                tensors=lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.o_proj\.weight.*weight_scale"):
        _load(bad)


def _bits(n):
    def edit(cfg):
        for g in cfg["quantization_config"]["config_groups"].values():
            g["weights"]["num_bits"] = n
        return cfg
    return edit


@pytest.mark.parametrize("meta", [None, _bare])
def test_num_bits_edited_is_refused_not_cut_to_fit(exports, tmp_path, meta):
    bad = copy_export(exports["int4"], tmp_path / "bits", config=_bits(3), metadata=meta)
    with pytest.raises(CheckpointError, match=r"(config\.json|num_bits)"):
        _load(bad)


def test_unpack_never_cuts_or_pads():
    u = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    w = pack_int32(u, 4)
    assert torch.equal(unpack_int32(w, 4, 64), u)
    for bits in (3, 5):
        with pytest.raises(ValueError, match="num_bits"):
            unpack_int32(w, bits, 64)
    with pytest.raises(ValueError, match="past its"):  # 60 codes fill 7.5 words: the last half must be zero
        unpack_int32(w, 4, 60)


def _set(path, value):
    def edit(cfg):
        d = cfg["quantization_config"]
        for k in path[:-1]:
            d = d[next(iter(d)) if k == "*" else k]
        if value is KeyError:
            del d[path[-1]]
        else:
            d[path[-1]] = value
        return cfg
    return edit


G = ("config_groups", "*")
W = G + ("weights",)


@pytest.mark.parametrize("path,value,key", [
    (("config_groups",), [], "config_groups"), (("config_groups",), KeyError, "config_groups"),
    (G + ("targets",), "Linear", "targets"), (G + ("targets",), KeyError, "targets"), (W, 4, "weights"),
    (W + ("num_bits",), "4", "num_bits"), (W + ("num_bits",), 0, "num_bits"), (W + ("group_size",), 0, "group_size"),
    (W + ("group_size",), KeyError, "group_size"), (W + ("strategy",), "rows", "strategy"),
    (W + ("type",), "bfloat", "type"), (W + ("symmetric",), "yes", "symmetric"), (W + ("dynamic",), 2, "dynamic"),
    (("ignore",), "lm_head", "ignore"), (("kv_cache_scheme",), 8, "kv_cache_scheme"), (("format",), 4, "format"),
])
def test_missing_or_mistyped_config_keys_are_refused_by_name(exports, tmp_path, path, value, key):
    bad = copy_export(exports["int4"], tmp_path / "cfg", config=_set(path, value))
    with pytest.raises((CheckpointError, ValueError, TypeError)) as e:
        _load(bad)
    assert "config.json" in str(e.value) and key in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) <= 2


@pytest.mark.parametrize("name,make", [
    ("model.layers.0.self_attn.o_proj.weight_scale", lambda t: t[:1]),
    ("model.layers.0.self_attn.o_proj.weight_packed", lambda t: t[:, :4]),
    ("model.layers.0.self_attn.o_proj.weight_packed", lambda t: t.to(torch.int64)),
    ("model.layers.0.self_attn.o_proj.weight_shape", lambda t: t * 2),
    ("model.layers.0.self_attn.o_proj.weight_shape", lambda t: t.float()),
])
def test_tensor_dtype_and_shape_against_the_config(exports, tmp_path, name, make):
    def edit(t):
        t[name] = make(t[name]).contiguous()
        return t
    bad = copy_export(exports["int4"], tmp_path / "t", tensors=edit, metadata=_bare)
    with pytest.raises(CheckpointError, match=r"o_proj"):
        _load(bad)


def test_recorded_specs_edited_are_refused(exports, tmp_path):
    bad = copy_export(exports["int4"], tmp_path / "hint", metadata=lambda m: {**m, "qtransform_config": "{not json"})
    with pytest.raises(CheckpointError, match="qtransform_config"):
        _load(bad)
