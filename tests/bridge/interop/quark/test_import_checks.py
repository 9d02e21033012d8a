"""The Quark importer validates what it reads before it builds anything: damaged or edited exports of our own are
refused with one ``CheckpointError`` (or ``ValueError``/``TypeError``) naming the file and the tensor or key,
never loaded with other numbers and never a raw ``KeyError``/``AttributeError``/``ZeroDivisionError``."""


import pytest
import torch
from bridge_util import copy_export, tiny_causal_lm

import bridge
import qtransform as qt
from bridge import interop
from bridge.checkpoint import CheckpointError
from qtransform.pipeline import linear_recipe

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
RECIPES = {"fp8": qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0)),
           "int4": qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))}


def _model():
    torch.manual_seed(0)
    return tiny_causal_lm("llama").eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root, out = tmp_path_factory.mktemp("quark-checks"), {}
    for name, spec in RECIPES.items():
        bridge.save(bridge.quantize(_model(), linear_recipe(spec)), root / f"{name}-ckpt")
        out[name] = interop.export(root / f"{name}-ckpt", to="quark", out=root / name)
    return out


def _copy(src, dst, *, keep_metadata=True, **edits):
    """:func:`copy_export`, the safetensors metadata (digests, recorded specs) dropped with ``keep_metadata=False``."""
    return copy_export(src, dst, metadata=None if keep_metadata else (lambda meta: None), **edits)


def _load(path, **kw):
    return bridge.load(path, like=_model(), **kw)


def _swap(a, b):
    def edit(t):
        t[a], t[b] = t[b], t[a]
        return t
    return edit


def test_unedited_exports_load_verified(exports):
    for path in exports.values():
        with torch.no_grad():
            assert torch.isfinite(_load(path)(IDS).logits).all()


def test_swapped_same_shape_tensors_are_refused_by_digest(exports, tmp_path):
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    bad = _copy(exports["int4"], tmp_path / "swapped", tensors=_swap(a, b))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*layers\.[01]\.self_attn\.q_proj\.weight.*(checksum|digest)"):
        _load(bad)
    _load(bad, verify=False)  # the switch skips the digests: the swap is not detectable otherwise
    with pytest.raises(TypeError, match="verify"):
        _load(bad, verify="no")


@pytest.mark.parametrize("keep_metadata", [True, False])
def test_quantized_weight_without_its_scale_is_refused(exports, tmp_path, keep_metadata):
    name = "model.layers.0.mlp.up_proj.weight_scale"
    bad = _copy(exports["fp8"], tmp_path / "noscale", keep_metadata=keep_metadata,
                tensors=lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*(scale|float8)"):
        _load(bad)


def test_scale_without_its_weight_is_refused(exports, tmp_path):
    bad = _copy(exports["fp8"], tmp_path / "noweight", keep_metadata=False,
                tensors=lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.down_proj.weight"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down_proj"):
        _load(bad)


def test_int4_edited_to_uint4_against_the_recorded_spec_is_refused(exports, tmp_path):
    def edit(cfg):
        cfg["quantization_config"]["global_quant_config"]["weight"]["dtype"] = "uint4"
        return cfg
    bad = _copy(exports["int4"], tmp_path / "uint4", config=edit)
    with pytest.raises(CheckpointError, match=r"config\.json.*int4"):
        _load(bad)


def _set(path, value):
    def edit(cfg):
        d = cfg["quantization_config"]
        for k in path[:-1]:
            d = d[k]
        if value is KeyError:
            del d[path[-1]]
        else:
            d[path[-1]] = value
        return cfg
    return edit


G = ("global_quant_config",)
W = G + ("weight",)


@pytest.mark.parametrize("path,value,key", [
    (G, "int4", "global_quant_config"), (G, KeyError, "global_quant_config"), (W, 4, "weight"),
    (W + ("dtype",), KeyError, "dtype"), (W + ("dtype",), 4, "dtype"), (W + ("group_size",), 0, "group_size"),
    (W + ("group_size",), "32", "group_size"), (W + ("qscheme",), KeyError, "qscheme"),
    (W + ("qscheme",), "per_block", "qscheme"), (W + ("symmetric",), "yes", "symmetric"),
    (W + ("ch_axis",), 1.5, "ch_axis"), (W + ("is_dynamic",), "no", "is_dynamic"),
    (("layer_quant_config",), [], "layer_quant_config"), (("layer_quant_config",), {"x*": 3}, "layer_quant_config"),
    (("exclude",), "lm_head", "exclude"), (("exclude",), [1], "exclude"), (("export",), [], "export"),
    (("export", "kv_cache_group"), "k_proj", "kv_cache_group"), (("export", "pack_method"), 3, "pack_method"),
    (("layer_type_quant_config",), {"Linear": "x"}, "layer_type_quant_config"),
    (("kv_cache_quant_config",), 7, "kv_cache_quant_config"), (("qtransform",), {"tensors": 1}, "qtransform"),
])
def test_missing_or_mistyped_config_keys_are_refused_by_name(exports, tmp_path, path, value, key):
    bad = _copy(exports["int4"], tmp_path / "cfg", config=_set(path, value))
    with pytest.raises((CheckpointError, ValueError, TypeError)) as e:
        _load(bad)
    assert "config.json" in str(e.value) and key in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) <= 2


def test_model_dtype_mistyped_is_refused(exports, tmp_path):
    def edit(cfg):
        cfg["dtype"] = 16
        cfg.pop("torch_dtype", None)
        return cfg
    with pytest.raises(CheckpointError, match=r"config\.json.*dtype"):
        _load(_copy(exports["int4"], tmp_path / "dt", config=edit))


@pytest.mark.parametrize("name,make", [
    ("model.layers.0.self_attn.o_proj.weight_scale", lambda t: t.to(torch.float16)),
    ("model.layers.0.self_attn.o_proj.weight_scale", lambda t: t[:1]),
    ("model.layers.0.self_attn.o_proj.weight_zero_point", lambda t: t[:1]),
    ("model.layers.0.self_attn.o_proj.weight_zero_point", lambda t: t.to(torch.int64)),
    ("model.layers.0.self_attn.o_proj.weight", lambda t: t[:, :4]),
    ("model.layers.0.self_attn.o_proj.weight", lambda t: t.to(torch.int64)),
])
def test_tensor_dtype_and_shape_against_the_config(exports, tmp_path, name, make):
    def edit(t):
        t[name] = make(t[name]).contiguous()
        return t
    bad = _copy(exports["int4"], tmp_path / "t", tensors=edit, keep_metadata=False)
    with pytest.raises(CheckpointError, match=r"o_proj"):
        _load(bad)
