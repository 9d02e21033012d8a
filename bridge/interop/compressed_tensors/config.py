"""compressed-tensors' quantization arguments for our specs, and our specs for theirs.

compressed-tensors (vLLM's checkpoint format) describes each group of layers by
``QuantizationArgs`` (JSON): ``num_bits``, ``type`` (``"int"`` or ``"float"``), ``symmetric``,
``strategy`` (``"tensor"``, ``"channel"`` = one scale per output row, ``"group"`` with
``group_size`` along the input features, ``"block"`` with ``block_structure``, ``"token"``,
``"tensor_group"`` = NVFP4's fp8 block scales under one fp32 scale) and ``dynamic``. Its codes
are signed (``[-2^(b-1), 2^(b-1) - 1]``, zero points too), so our unsigned formats map by an
offset of ``2^(b-1)``; its only 8-bit float is e4m3fn; zero points are integers.

Each :class:`Mapping` says how one spec is stored: the ``args``, the storage ``kind``
(:mod:`.tensors` converts the tensors) and the ``format`` (compressor) name.
:func:`judge` answers :meth:`~bridge.interop.Exporter.support`; :func:`nearest` is the spec a
``"nearest"`` export re-quantizes to; :func:`spec_of` reads args back into our spec.

>>> import qtransform as qt
>>> m = weight_mapping(qt.QuantSpec(format="uint4", granularity=qt.PerGroup(32), symmetric=False))
>>> m.kind, m.args["num_bits"], m.args["strategy"], m.args["group_size"], m.args["symmetric"]
('pack', 4, 'group', 32, False)
>>> judge(qt.QuantSpec(format="nf4"), "weight").kind
'no'
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import qtransform as qt

from ..base import FLOAT_SCALES, Support

__all__ = ["Mapping", "weight_mapping", "activation_args", "judge", "nearest", "compression_format", "spec_of",
           "activation_spec_of", "MX_KINDS"]

#: Our MX formats compressed-tensors holds: format name -> (storage kind, its format name, bits).
MX_KINDS = {"mxfp4": ("mxfp4", "mxfp4-pack-quantized", 4), "mxfp6_e2m3": ("mxfp6", "mxfp6-pack-quantized", 6),
            "mxfp8_e4m3": ("mxfp8", "mxfp8-quantized", 8)}
_NEAREST_FORMAT = {"fp8_e5m2": "fp8_e4m3", "fp8_e4m3fnuz": "fp8_e4m3", "fp8_e5m2fnuz": "fp8_e4m3",
                   "mxfp8_e5m2": "mxfp8_e4m3", "mxfp6_e3m2": "mxfp6_e2m3"}


class Mapping(NamedTuple):
    """How a weight spec is stored: ``args`` (QuantizationArgs as JSON), the storage ``kind``
    (``"pack"``, ``"int"``, ``"float"``, ``"mxfp4"``, ``"mxfp6"``, ``"mxfp8"``, ``"nvfp4"``) and
    ``format``, the compressor (``None``: chosen with the activations, :func:`compression_format`)."""

    args: dict
    kind: str
    format: str | None


def _why(spec: qt.QuantSpec) -> str | None:
    """Why compressed-tensors cannot hold ``spec`` as it is (``None``: it can, or nearly)."""
    fmt = spec.fmt
    if fmt.family == "int":
        if spec.scale_dtype not in FLOAT_SCALES and spec.scale_dtype != "e8m0":
            return f"scale dtype {spec.scale_dtype}"
        return None
    if spec.format in ("fp8_e4m3", "nvfp4") or spec.format in MX_KINDS or spec.format in _NEAREST_FORMAT:
        return None
    if fmt.family in ("mx", "microexp", "bfp"):
        return f"{spec.format}: compressed-tensors' MX formats are MXFP4, MXFP6 e2m3 and MXFP8 e4m3"
    if fmt.family == "codebook":
        return f"{spec.format}: a codebook format; compressed-tensors stores integers and floats only"
    if fmt.family == "cast":
        return f"{spec.format}: a plain cast (keep the tensor unquantized instead)"
    return f"{spec.format}: compressed-tensors' float formats are fp8 e4m3 (per tensor/channel/group/block), " \
           "MXFP4/6/8 and NVFP4"


def _strategy(spec: qt.QuantSpec) -> tuple[dict | None, str]:
    """``strategy`` / ``group_size`` / ``block_structure`` of a weight spec's granularity, or why not."""
    g = spec.granularity
    if isinstance(g, qt.PerTensor):
        return {"strategy": "tensor"}, ""
    if isinstance(g, qt.PerChannel):
        if g.axis != 0:
            return None, f"per-channel along axis {g.axis}: compressed-tensors' channels are output rows (axis 0)"
        return {"strategy": "channel"}, ""
    if isinstance(g, qt.PerGroup):
        if g.axis != -1:
            return None, f"groups along axis {g.axis}: compressed-tensors' groups run along the input features (-1)"
        return {"strategy": "group", "group_size": g.size}, ""
    if isinstance(g, qt.PerBlock) and len(g.shape) == 2:
        return {"strategy": "block", "block_structure": list(g.shape)}, ""
    return None, f"granularity {g}: compressed-tensors has tensor, channel, group and 2-D block scales"


def nearest(spec: qt.QuantSpec) -> qt.QuantSpec:
    """The spec compressed-tensors holds that a ``"nearest"`` export re-quantizes ``spec`` to
    (``spec`` itself when it is held exactly)."""
    if spec.fmt.family == "int" and not spec.symmetric and spec.zero_point_domain != "int":
        return spec.replace(zero_point_domain="int")
    if spec.format in _NEAREST_FORMAT:
        target = _NEAREST_FORMAT[spec.format]
        return spec.replace(format=target, granularity=None if target in MX_KINDS else spec.granularity,
                            scale_rule=None if target in MX_KINDS else spec.scale_rule)
    if spec.symmetric_range == "restricted" and spec.dynamic:
        return spec.replace(symmetric_range="full")
    return spec


def _nearest_note(spec: qt.QuantSpec) -> str:
    if spec.fmt.family == "int" and not spec.symmetric and spec.zero_point_domain != "int":
        return f"{spec.zero_point_domain} zero point (HQQ, GGUF): compressed-tensors' zero points are integers; " \
               "re-quantized with an integer zero point on the same groups"
    if spec.format in _NEAREST_FORMAT:
        return f"{spec.format}: compressed-tensors has no such element type; re-quantized as {_NEAREST_FORMAT[spec.format]}"
    return "restricted range [-qmax, qmax]: compressed-tensors computes dynamic scales as amax / ((qmax - qmin) / 2)"


def weight_mapping(spec: qt.QuantSpec) -> Mapping:
    """How compressed-tensors stores a weight quantized with ``spec`` (``ValueError`` if it cannot;
    a spec held only approximately must go through :func:`nearest` first)."""
    s = judge(spec, "weight")
    if s.kind != "exact":
        raise ValueError(f"compressed-tensors cannot hold {spec} exactly: {s.note}")
    if spec.format == "nvfp4":
        return Mapping({"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                        "group_size": 16, "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},
                       "nvfp4", "nvfp4-pack-quantized")
    if spec.format in MX_KINDS:
        kind, fmt, bits = MX_KINDS[spec.format]
        return Mapping({"num_bits": bits, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                        "dynamic": False, "scale_dtype": "torch.uint8"}, kind, fmt)
    strategy, _ = _strategy(spec)
    if spec.format == "fp8_e4m3":
        return Mapping({"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **strategy},
                       "float", None)
    bits = spec.fmt.codec.bits
    return Mapping({"num_bits": bits, "type": "int", "symmetric": spec.symmetric, "dynamic": False, **strategy},
                   "pack", None)


def activation_args(spec: qt.QuantSpec, role: str) -> dict:
    """QuantizationArgs (JSON) of an activation quantizer (``input``/``output`` of a layer, or the
    key/value cache); ``ValueError`` when :func:`judge` does not say ``"exact"``."""
    s = judge(spec, role)
    if s.kind != "exact":
        raise ValueError(f"compressed-tensors cannot hold the {role} quantizer {spec} exactly: {s.note}")
    g = spec.granularity
    strategy = {"strategy": "tensor"} if isinstance(g, qt.PerTensor) else \
        {"strategy": "attn_head"} if role in qt.spec.KV_ROLES else \
        {"strategy": "token"} if isinstance(g, qt.PerChannel) else {"strategy": "group", "group_size": g.size}
    if spec.format == "fp8_e4m3":
        return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": spec.dynamic, **strategy}
    return {"num_bits": spec.fmt.codec.bits, "type": "int", "symmetric": spec.symmetric, "dynamic": spec.dynamic,
            **strategy}


def _judge_activation(spec: qt.QuantSpec, role: str) -> Support:
    if spec.format not in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz") and spec.fmt.family != "int":
        return Support("no", f"{role} activations in {spec.format}: compressed-tensors quantizes activations "
                             "(and the key/value cache) to int or fp8 e4m3 here")
    if spec.format != "fp8_e4m3" and spec.fmt.family != "int":
        return Support("no", f"{role} activations in {spec.format}: compressed-tensors' 8-bit float is e4m3fn")
    if not spec.symmetric and spec.zero_point_domain != "int":
        return Support("no", f"{role} activations with a float zero point")
    g = spec.granularity
    if role in qt.spec.KV_ROLES:
        if spec.dynamic or not qt.spec.is_kv_granularity(g) or not spec.symmetric:
            return Support("no", "the key/value cache: compressed-tensors (and vLLM) take static symmetric "
                                 "k_scale/v_scale per tensor (strategy 'tensor') or per key/value head ('attn_head')")
    elif isinstance(g, qt.PerChannel):
        if g.axis != 0 or not spec.dynamic:
            return Support("no", f"{role} activations per channel along axis {g.axis}"
                                 f"{'' if spec.dynamic else ' (static)'}: compressed-tensors has per-tensor, "
                                 "dynamic per-token (axis 0) and group scales")
    elif isinstance(g, qt.PerGroup):
        if g.axis != -1 or not spec.dynamic:
            return Support("no", f"{role} activations in static groups or along axis {g.axis}: compressed-tensors "
                                 "takes dynamic groups of features")
    elif not isinstance(g, qt.PerTensor):
        return Support("no", f"{role} activations per {g}")
    if spec.scale_dtype not in FLOAT_SCALES:
        return Support("no", f"{role} activations with {spec.scale_dtype} scales")
    if spec.symmetric_range == "restricted":
        if spec.dynamic:
            return Support("nearest", _nearest_note(spec))
        return Support("no", "static restricted-range integer activations: compressed-tensors clamps codes to "
                             "[qmin, qmax], not [-qmax, qmax]")
    return Support("exact", "")


def judge(spec: qt.QuantSpec, role: str = "weight") -> Support:
    """Can compressed-tensors hold ``spec`` (in ``role``)? ``"exact"`` (bit for bit), ``"nearest"``
    (re-quantized to :func:`nearest`; the note says what is lost) or ``"no"`` with the reason."""
    if not isinstance(spec, qt.QuantSpec):
        raise TypeError(f"compressed-tensors: spec must be a QuantSpec, got {type(spec).__name__}")
    if role != "weight":
        return _judge_activation(spec, role)
    if spec.dynamic:
        return Support("no", "a dynamic weight spec")
    why = _why(spec)
    if why is not None:
        return Support("no", why)
    if spec.fmt.block is not None:  # MX and NVFP4: blocks along the input features
        if spec.granularity.axis != -1:
            return Support("no", f"{spec.format} blocks along axis {spec.granularity.axis}: compressed-tensors' "
                                 "blocks run along the input features (-1)")
    else:
        strategy, why = _strategy(spec)
        if strategy is None:
            return Support("no", why)
        if spec.fmt.family != "int" and spec.scale_dtype not in FLOAT_SCALES:
            return Support("no", f"fp8 weights with {spec.scale_dtype} scales")
    if spec.format in _NEAREST_FORMAT or (spec.fmt.family == "int" and not spec.symmetric
                                          and spec.zero_point_domain != "int"):
        return Support("nearest", _nearest_note(spec))
    if spec.fmt.family == "int" and spec.scale_dtype == "e8m0":
        return Support("exact", "power-of-two scales stored as float32")
    if spec.fmt.family == "int" and spec.fmt.codec.bits not in (4, 8):
        return Support("exact", f"{spec.fmt.codec.bits}-bit codes in compressed-tensors' dense packing "
                                "(0.20 and later; vLLM's kernels take 4 and 8 bits)")
    return Support("exact", "")


def compression_format(mapping: Mapping, input_args: dict | None) -> str:
    """The compressor of a layer, as compressed-tensors infers it (vLLM reads the same names)."""
    if mapping.format is not None:
        return mapping.format
    if mapping.kind == "pack":
        return "int-quantized" if input_args is not None and input_args["type"] == "int" else "pack-quantized"
    return "float-quantized" if input_args is not None else "naive-quantized"


# ---------------------------------------------------------------------------------------- reading back

def _granularity(args: dict, where: str):
    strategy = args.get("strategy") or ("group" if (args.get("group_size") or 0) > 0 else
                                        "channel" if args.get("group_size") == -1 else "tensor")
    if strategy == "tensor":
        return qt.PerTensor()
    if strategy == "channel":
        return qt.PerChannel(0)
    if strategy in ("group", "tensor_group"):
        return qt.PerGroup(int(args["group_size"]))
    if strategy == "block":
        return qt.PerBlock(tuple(int(n) for n in args["block_structure"]))
    raise ValueError(f"{where}: compressed-tensors strategy {strategy!r} has no qtransform equivalent")


def spec_of(args: dict, fmt: str, scale_dtype: torch.dtype, *, where: str) -> tuple[qt.QuantSpec, str]:
    """Our spec and storage kind of a weight stored with ``args`` by compressor ``fmt`` whose
    ``weight_scale`` has ``scale_dtype``; ``ValueError`` naming ``where`` when none fits."""
    bits, typ, sym = int(args.get("num_bits", 8)), args.get("type", "int"), bool(args.get("symmetric", True))
    if args.get("dynamic"):
        raise ValueError(f"{where}: dynamic weight quantization")
    if fmt == "nvfp4-pack-quantized" and bits == 4 and typ == "float":
        return qt.QuantSpec(format="nvfp4"), "nvfp4"
    for name, (kind, f, b) in MX_KINDS.items():
        if fmt == f and bits == b and typ == "float":
            return qt.QuantSpec(format=name), kind
    sd = str(scale_dtype).removeprefix("torch.")
    if sd not in FLOAT_SCALES:
        raise ValueError(f"{where}: weight_scale of dtype {sd} (expected one of {list(FLOAT_SCALES)})")
    gran = _granularity(args, where)
    if typ == "float":
        if bits != 8 or not sym:
            raise ValueError(f"{where}: {'asymmetric ' if not sym else ''}{bits}-bit float weights in {fmt}")
        return qt.QuantSpec(format="fp8_e4m3", granularity=gran, scale_dtype=sd), "float"
    if typ != "int" or not 1 <= bits <= 8:
        raise ValueError(f"{where}: {bits}-bit {typ} weights")
    if fmt not in ("pack-quantized", "int-quantized", "naive-quantized"):
        raise ValueError(f"{where}: integer weights in format {fmt!r}")
    spec = qt.QuantSpec(format=f"int{bits}" if sym else f"uint{bits}", granularity=gran, symmetric=sym,
                        scale_dtype=sd)
    return spec, "pack" if fmt == "pack-quantized" else "int"


def activation_spec_of(args: dict, scale_dtype: torch.dtype | None, *, where: str) -> qt.QuantSpec:
    """Our spec of an activation (or key/value cache) quantizer stored with ``args``."""
    bits, typ, sym = int(args.get("num_bits", 8)), args.get("type", "int"), bool(args.get("symmetric", True))
    strategy = args.get("strategy") or "tensor"
    dynamic = args.get("dynamic", False)
    if dynamic not in (True, False):
        raise ValueError(f"{where}: activation quantization with dynamic={dynamic!r}")
    gran = {"tensor": qt.PerTensor(), "token": qt.PerChannel(0), "attn_head": qt.PerChannel(1)}.get(strategy)
    if strategy == "group":
        gran = qt.PerGroup(int(args["group_size"]))
    if gran is None:
        raise ValueError(f"{where}: activation strategy {strategy!r} has no qtransform equivalent")
    sd = "float32" if scale_dtype is None else str(scale_dtype).removeprefix("torch.")
    if sd not in FLOAT_SCALES:
        raise ValueError(f"{where}: activation scale of dtype {sd}")
    if typ == "float" and bits == 8 and sym:
        return qt.QuantSpec(format="fp8_e4m3", granularity=gran, dynamic=dynamic, scale_dtype=sd)
    if typ == "int" and 2 <= bits <= 8:
        return qt.QuantSpec(format=f"int{bits}", granularity=gran, symmetric=sym, dynamic=dynamic, scale_dtype=sd)
    raise ValueError(f"{where}: {bits}-bit {typ} {'symmetric' if sym else 'asymmetric'} activations")
