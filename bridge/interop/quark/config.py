"""Quark's description of one quantized tensor (its ``QTensorConfig`` as JSON) and ours, both ways.

Quark's HF-format checkpoints (``quant_method: "quark"``) describe each quantizer by a JSON object
(``dtype``, ``qscheme``, ``ch_axis``, ``group_size``, ``symmetric``, ``scale_format``,
``zero_point_type``, ``is_dynamic``...): :func:`tensor_config` writes it for a
:class:`~qtransform.QuantSpec` and :func:`spec_of` reads one back. :func:`judge` says whether
a spec can be exported at all (``"exact"``, ``"nearest"`` with what is lost, or ``"no"`` with why):

=====================================  =====================================================
ours                                   Quark (what transformers' Quark loader reads)
=====================================  =====================================================
int4 / uint4 / int8 / uint8 weights    same dtype; per_tensor, per_channel (axis 0), per_group
                                       along the input features; int or float32 zero point
fp8_e4m3 / fp8_e5m2 weights            same dtype; per_tensor, per_channel (axis 0)
mxfp4, mxfp6_e3m2/e2m3, mxfp8_*        fp4 / fp6_* / fp8_* per_group 32, ``scale_format: e8m0``
static per-tensor activations          ``input_tensors`` / ``output_tensors`` (fp8, int8, uint8)
static per-tensor fp8_e4m3 KV cache    ``output_tensors`` of ``k_proj`` / ``v_proj``
=====================================  =====================================================

Decoding is ``(code - zero_point) * scale`` in float32 on both sides, so these are bit for bit.
The fields Quark has no room for (a restricted symmetric range, the rounding mode and scale rule
used when quantizing) change no decoded value; the exporter keeps our specs beside Quark's under
``quantization_config["qtransform"]`` so that reading the export back gives the same specs.

>>> import qtransform as qt
>>> d = tensor_config(qt.QuantSpec(format="int4", granularity=qt.PerGroup(32)), "weight")
>>> d["dtype"], d["qscheme"], d["group_size"], d["symmetric"]
('int4', 'per_group', 32, True)
>>> judge(qt.QuantSpec(format="nf4", granularity=qt.PerGroup(64)), "weight").kind
'no'
"""

from __future__ import annotations

import qtransform as qt

from ..base import FLOAT_SCALES, Support

__all__ = ["INT_DTYPES", "FP8_DTYPES", "MX_DTYPES", "judge", "tensor_config", "spec_of",
           "decodes_alike"]

#: Our integer formats Quark packs the way its loader unpacks them (4 bits in int32 words, 8 bits as bytes).
INT_DTYPES = ("int4", "uint4", "int8", "uint8")
#: Our fp8 formats and Quark's dtype names for them.
FP8_DTYPES = {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
#: Our OCP MX formats and Quark's element dtype (per_group 32, e8m0 scales).
MX_DTYPES = {"mxfp4": "fp4", "mxfp6_e3m2": "fp6_e3m2", "mxfp6_e2m3": "fp6_e2m3",
             "mxfp8_e4m3": "fp8_e4m3", "mxfp8_e5m2": "fp8_e5m2"}
_ACT_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "uint8")
_OBSERVERS = {"per_tensor": "PerTensorMinMaxObserver", "per_channel": "PerChannelMinMaxObserver",
              "per_group": "PerGroupMinMaxObserver"}
_WHY_NOT = {
    "nf4": "a codebook format; Quark has no codebook dtype",
    "nvfp4": "NVFP4's two-level scales (fp8 block scales times an fp32 tensor scale) are not written by this "
             "exporter",
    "mxint8": "Quark's MX int8 (dtype 'mx') has no forward in the quantized linear that transformers loads",
    "mx4": "Quark cannot export its MX4/MX6/MX9/BFP16 formats", "mx6": "Quark cannot export its MX4/MX6/MX9/BFP16 "
    "formats", "mx9": "Quark cannot export its MX4/MX6/MX9/BFP16 formats", "bfp16": "Quark cannot export its "
    "MX4/MX6/MX9/BFP16 formats",
    "fp8_e4m3fnuz": "Quark's checkpoints hold OCP fp8 (e4m3fn), not the fnuz variant",
    "fp8_e5m2fnuz": "Quark's checkpoints hold OCP fp8 (e5m2), not the fnuz variant",
}


def _why_not(spec: qt.QuantSpec, role: str) -> str | None:
    """Why ``spec`` cannot be exported in ``role`` (``None``: it can, maybe as the nearest)."""
    name, g = spec.format, spec.granularity
    if name in _WHY_NOT:
        return _WHY_NOT[name]
    if role != "weight":
        return _why_not_activation(spec, role)
    if spec.dynamic:
        return "a dynamic weight spec (Quark stores weights quantized)"
    if name in MX_DTYPES:
        if g.axis not in (-1, 1):
            return f"MX blocks along axis {g.axis}; Quark's run along the input features (axis -1)"
        return None
    if name in FP8_DTYPES or name in INT_DTYPES:
        if spec.scale_dtype not in FLOAT_SCALES:
            return f"scale_dtype {spec.scale_dtype!r}; Quark's {name} scales are floats"
        if isinstance(g, qt.PerChannel) and g.axis != 0:
            return f"per-channel scales along axis {g.axis}; Quark's run along the output channels (axis 0)"
        if isinstance(g, qt.PerBlock):
            return "2-D blocks; Quark's per_block is written for fp8 only by its own flow"
        if isinstance(g, qt.PerGroup) and (g.axis not in (-1, 1) or name in FP8_DTYPES):
            return ("fp8 groups: Quark's loader dequantizes fp8 per tensor, per channel or per 2-D block only"
                    if name in FP8_DTYPES else f"groups along axis {g.axis}; Quark's run along the input features")
        if name in INT_DTYPES and not spec.symmetric:
            if spec.zero_point_domain in ("float", "offset") and isinstance(g, qt.PerChannel):
                return "a float zero point per channel (Quark stores float zero points per tensor or per group)"
            if name == "int4" and isinstance(g, qt.PerTensor) and spec.zero_point_domain == "int":
                return "a per-tensor int4 zero point (Quark's loader does not sign-extend a scalar int4 zero point)"
        return None
    if spec.fmt.family == "int":
        return f"{spec.fmt.codec.bits}-bit integers; Quark packs 4- and 8-bit integers only"
    return f"format {name}; Quark has no such dtype"


def _why_not_activation(spec: qt.QuantSpec, role: str) -> str | None:
    if spec.dynamic:
        return "dynamic activation quantization (only static scales are exported)"
    if not isinstance(spec.granularity, qt.PerTensor):
        return f"{spec.granularity} activation scales; Quark's static activation scales are per tensor"
    if role in ("key", "value"):
        if spec.format != "fp8_e4m3" or not spec.symmetric:
            return "a key/value cache other than symmetric fp8_e4m3 (the one Quark's KV cache export holds)"
    elif spec.format not in _ACT_FORMATS:
        return f"{spec.format} activations; Quark's static activations are fp8_e4m3, fp8_e5m2, int8 or uint8"
    if spec.scale_dtype not in FLOAT_SCALES:
        return f"scale_dtype {spec.scale_dtype!r} (Quark's activation scales are floats)"
    if not spec.symmetric and spec.zero_point_domain != "int":
        return f"a {spec.zero_point_domain} zero point on activations (Quark rounds activation zero points)"
    if spec.rounding != "half_even":
        return f"rounding {spec.rounding!r} (Quark rounds activations half to even)"
    return None


def _nearest(spec: qt.QuantSpec, role: str) -> str | None:
    """What is lost when ``spec`` is exported as Quark's nearest (``None``: nothing)."""
    if role == "weight" and spec.zero_point_domain == "offset":
        return ("an offset zero point (x = code * scale + m) becomes Quark's float zero point -m / scale "
                "(float32): values change by about one float32 rounding")
    if role != "weight" and spec.restricted:
        return "a restricted symmetric range: Quark clamps activations to the full integer range"
    if role != "weight" and not spec.saturate:
        return "saturate=False: Quark clamps fp8 activations at the largest finite value"
    return None


def judge(spec: qt.QuantSpec, role: str = "weight") -> Support:
    """Can Quark hold a tensor quantized with ``spec`` in ``role`` (``"weight"``, ``"input"``,
    ``"output"``, ``"key"``, ``"value"``)? The note names Quark's dtype, or says what is lost / why not."""
    if not isinstance(spec, qt.QuantSpec):
        raise TypeError(f"quark: spec must be a QuantSpec, got {type(spec).__name__}")
    if role not in ("weight",) + qt.spec.SITE_ROLES:
        raise ValueError(f"quark: role must be 'weight' or one of {list(qt.spec.SITE_ROLES)}, got {role!r}")
    why = _why_not(spec, role)
    if why is not None:
        return Support("no", why)
    lost = _nearest(spec, role)
    if lost is not None:
        return Support("nearest", lost)
    d = tensor_config(spec, role)
    note = f"quark {d['dtype']} {d['qscheme']}"
    if spec.format.startswith("mxfp8"):
        note += (" (Quark 0.13's transformers loader cannot dequantize per-group fp8 and vLLM reads MX fp4/fp6 only: "
                 "the file is Quark's MXFP8, but nothing runs it yet)")
    elif role in ("input", "output") and spec.format in INT_DTYPES:
        note += " (Quark rounds x * (1 / scale) where we round x / scale: about one value in a million differs at a tie)"
    return Support("exact", note)


def tensor_config(spec: qt.QuantSpec, role: str = "weight") -> dict:
    """Quark's ``QTensorConfig`` dict for ``spec`` (``ValueError`` when :func:`judge` says ``"no"``)."""
    why = _why_not(spec, role)
    if why is not None:
        raise ValueError(f"quark cannot hold {spec}: {why}")
    g = spec.granularity
    d = {"dtype": None, "is_dynamic": False, "qscheme": None, "ch_axis": None, "group_size": None,
         "block_size": None, "symmetric": True, "round_method": "half_even", "scale_type": "float",
         "zero_point_type": "int32", "scale_format": None, "scale_calculation_mode": None, "mx_element_dtype": None,
         "observer_cls": None, "is_scale_quant": False, "enable_buffer_reuse": False, "max_input_numel": 4194304}
    if spec.format in MX_DTYPES:
        rule = spec.scale_rule if spec.scale_rule in ("even", "floor") else None
        d.update(dtype=MX_DTYPES[spec.format], qscheme="per_group", ch_axis=-1, group_size=g.size, symmetric=None,
                 scale_format="e8m0", scale_calculation_mode=rule, observer_cls="PerBlockMXObserver")
        return d
    d["dtype"] = FP8_DTYPES.get(spec.format, spec.format)
    if isinstance(g, qt.PerTensor):
        d["qscheme"] = "per_tensor"
    elif isinstance(g, qt.PerChannel):
        d.update(qscheme="per_channel", ch_axis=0)
    else:
        d.update(qscheme="per_group", ch_axis=-1, group_size=g.size)
    d["observer_cls"] = _OBSERVERS[d["qscheme"]]
    d["symmetric"] = bool(spec.symmetric)
    if not spec.symmetric and spec.zero_point_domain in ("float", "offset"):
        d["zero_point_type"] = "float32"
    return d


def _granularity(d: dict, where: str) -> qt.Granularity:
    scheme = d.get("qscheme")
    if scheme == "per_tensor":
        return qt.PerTensor()
    if scheme == "per_channel" and d.get("ch_axis") == 0:
        return qt.PerChannel(0)
    if scheme == "per_group" and d.get("ch_axis") in (-1, 1) and isinstance(d.get("group_size"), int):
        return qt.PerGroup(d["group_size"])
    raise ValueError(f"{where}: Quark qscheme {scheme!r} with ch_axis {d.get('ch_axis')!r} and group_size "
                     f"{d.get('group_size')!r} has no qtransform granularity")


def spec_of(d: dict, *, scale_dtype: str, symmetric: bool, where: str) -> qt.QuantSpec:
    """Our :class:`~qtransform.QuantSpec` for Quark's ``QTensorConfig`` dict ``d``.

    ``scale_dtype`` (``"float32"``...; MX: ``"e8m0"``) and ``symmetric`` come from the stored tensors
    (the scale's dtype; whether the zero points are the symmetric ones). ``ValueError`` naming
    ``where`` for a dtype or scheme with no qtransform equivalent."""
    if not isinstance(d, dict):
        raise TypeError(f"{where}: a Quark tensor config must be a JSON object, got {type(d).__name__}")
    if d.get("is_dynamic"):
        raise ValueError(f"{where}: dynamic Quark quantizers are not imported")
    if isinstance(d.get("weight"), list) or isinstance(d, list):
        raise ValueError(f"{where}: two-stage Quark quantizers are not imported")
    dtype, fmt = d.get("dtype"), None
    if d.get("scale_format") == "e8m0":
        fmt = {v: k for k, v in MX_DTYPES.items()}.get(dtype)
        if fmt is None or d.get("qscheme") != "per_group" or d.get("group_size") != 32 or d.get("ch_axis") not in (-1, 1):
            raise ValueError(f"{where}: Quark dtype {dtype!r} with e8m0 scales ({d.get('qscheme')}, group "
                             f"{d.get('group_size')}) is not an OCP MX format qtransform reads")
        mode = d.get("scale_calculation_mode")
        return qt.QuantSpec(format=fmt, scale_rule=mode if mode in ("even", "floor") else None)
    if d.get("scale_format") not in (None, "float32"):
        raise ValueError(f"{where}: Quark scale_format {d.get('scale_format')!r} is not read")
    if dtype in INT_DTYPES:
        fmt = dtype
    elif dtype in FP8_DTYPES.values():
        fmt = {v: k for k, v in FP8_DTYPES.items()}[dtype]
    if fmt is None:
        raise ValueError(f"{where}: Quark dtype {dtype!r} has no qtransform format that this importer reads")
    gran = _granularity(d, where)
    if fmt in INT_DTYPES and not symmetric:
        domain = "float" if d.get("zero_point_type") == "float32" else "int"
        return qt.QuantSpec(format=fmt, granularity=gran, symmetric=False, zero_point_domain=domain,
                            scale_dtype=scale_dtype)
    return qt.QuantSpec(format=fmt, granularity=gran, scale_dtype=scale_dtype)


def decodes_alike(a: qt.QuantSpec, b: qt.QuantSpec) -> bool:
    """Whether two specs decode the same stored tensors to the same values (format, granularity,
    zero point kind and scale dtype agree; rounding, scale rule or a restricted range do not matter)."""
    return (a.format, a.granularity, a.symmetric, a.zero_point_domain, a.scale_dtype) == \
        (b.format, b.granularity, b.symmetric, b.zero_point_domain, b.scale_dtype)
