"""Named recipes (in the spirit of Quark's templates), in a registry.

A :class:`Preset` is a named recipe for the linear layers of a model, with the steps that fit
its parameters (none: round to nearest; ``hqq`` with its options...). Presets name formats of
the registry; a preset whose format is not registered is not offered. Group presets pad
(``pad=True``): an axis their group does not divide (SmolLM2's 576-wide layers with group 128)
gets a last, partial group, so every preset works on every model.

>>> import qtransform as qt
>>> p = qt.get_preset("hqq4-g64")
>>> p.recipe.steps, str(p.recipe.type_rules[0][1])
((Step('hqq', error_norm=4.0, refine_scale=False),), 'uint4 g64 asym(float zp)')

The HQQ presets pick the solver options with the lowest perplexity on SmolLM2-135M
(bench/bench_hqq.py): iterates ranked by the 4-norm of the group error, and the scale refined
at 3 and 2 bits only. ``register_preset`` adds yours (the command line lists it).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..algorithms.gptq import LINEAR_TYPES  # the module types a preset quantizes: the linear layers
from ..granularity import PerChannel, PerGroup
from ..registry import Registry
from ..spec import QuantSpec, Recipe, Step

__all__ = ["Preset", "PRESETS", "register_preset", "presets", "get_preset", "hqq_spec", "linear_recipe",
          
           "LINEAR_TYPES", "DEFAULT_EXCLUDE"]

#: What presets keep in full precision.
DEFAULT_EXCLUDE = ("lm_head*",)


class Preset(NamedTuple):
    """A named recipe, with a line for people."""

    name: str
    recipe: Recipe
    description: str

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.recipe.steps

    @property
    def spec(self) -> QuantSpec | None:
        """The spec its linear layers get (the first type rule), if it has one."""
        return self.recipe.type_rules[0][1] if self.recipe.type_rules else self.recipe.default


def hqq_spec(nbits: int, group_size: int | None = 64, *, axis: int = 1) -> QuantSpec:
    """HQQ's scheme: unsigned ``nbits`` codes, float zero point, fp16 scale and zero, groups
    along in_features (``axis=1``, the kernels' layout) or down a column (``axis=0``); a group
    that does not divide its axis is padded."""
    if axis not in (0, 1):
        raise ValueError(f"hqq axis must be 0 or 1, got {axis!r}")
    gran = PerChannel(0) if group_size is None else PerGroup(group_size, axis=-1 if axis == 1 else 0)
    return QuantSpec(format=f"uint{nbits}", granularity=gran, symmetric=False, zero_point_domain="float",
                     scale_dtype="float16", pad=group_size is not None)


def linear_recipe(spec: QuantSpec, *steps: Step | str, input: QuantSpec | None = None) -> Recipe:
    """``spec`` for every linear layer (``Linear`` and transformers' ``Conv1D``), ``lm_head`` kept,
    fitted by ``steps``; ``input``: the activation spec of their inputs (W8A8)."""
    return Recipe(type_rules={t: spec for t in LINEAR_TYPES}, exclude=DEFAULT_EXCLUDE, steps=steps, input=input)


def _check_preset(name: str, make) -> None:
    if not callable(make):
        raise TypeError(f"register_preset {name}: expected a function returning a Preset, got {type(make).__name__}")


#: The registry: preset name -> a function that builds the :class:`Preset` (specs are built on
#: demand, so that a preset whose format is not registered is simply not offered).
PRESETS = Registry("recipe", check=_check_preset)


def register_preset(name: str, make: Callable[[], Preset], *, replace: bool = False) -> Callable[[], Preset]:
    """Register ``make() -> Preset`` under ``name``; ``make`` raises ``ValueError`` when its format is
    not registered (the preset is then not offered)."""
    return PRESETS.register(name, make, replace=replace)


def _builtin(name: str, make_spec: Callable[[], QuantSpec], description: str, *steps: Step | str) -> None:
    register_preset(name, lambda: Preset(name, linear_recipe(make_spec(), *steps), description))


for _g in (32, 64, 128):
    _builtin(f"int4-g{_g}", lambda g=_g: QuantSpec(format="int4", granularity=PerGroup(g), pad=True),
             f"int4 symmetric weight-only, group {_g}")
    _builtin(f"int4-g{_g}-asym", lambda g=_g: QuantSpec(format="uint4", granularity=PerGroup(g), symmetric=False,
                                           pad=True),
             f"uint4 asymmetric (integer zero point) weight-only, group {_g}")
_builtin("int8-channel", lambda: QuantSpec(format="int8", granularity=PerChannel(0)),
         "int8 symmetric weight-only, per output channel")
_builtin("hqq4-g64", lambda: hqq_spec(4, 64), "HQQ 4-bit, group 64 (uint4, float zero point)",
         Step("hqq", error_norm=4.0, refine_scale=False))
_builtin("hqq3-g64", lambda: hqq_spec(3, 64), "HQQ 3-bit, group 64", Step("hqq", error_norm=4.0))
_builtin("hqq2-g16", lambda: hqq_spec(2, 16), "HQQ 2-bit, group 16", Step("hqq", error_norm=4.0))
_builtin("fp8", lambda: QuantSpec(format="fp8_e4m3", granularity=PerChannel(0)),
         "fp8 e4m3 weight-only, per output channel")
_builtin("mxfp4", lambda: QuantSpec(format="mxfp4"), "OCP MXFP4 (e2m1, block 32, E8M0 scales)")
_builtin("mxfp6", lambda: QuantSpec(format="mxfp6_e2m3"), "OCP MXFP6 e2m3 (block 32)")
_builtin("mxfp8", lambda: QuantSpec(format="mxfp8_e4m3"), "OCP MXFP8 e4m3 (block 32)")
_builtin("nvfp4", lambda: QuantSpec(format="nvfp4"), "NVFP4 (e2m1, block 16, fp8 block scales, fp32 tensor scale)")
_builtin("mx6", lambda: QuantSpec(format="mx6"), "MX6 (shared micro-exponents, 6 bits/weight)")
_builtin("mx9", lambda: QuantSpec(format="mx9"), "MX9 (shared micro-exponents, 9 bits/weight)")
_builtin("bfp16", lambda: QuantSpec(format="bfp16"), "block floating point, block 8, int8 codes")


def _w8a8(name: str, weight: Callable[[], QuantSpec], act: Callable[[], QuantSpec], description: str,
          *steps: Step) -> None:
    register_preset(name, lambda: Preset(name, linear_recipe(weight(), *steps, input=act()), description))


_w8a8("w8a8-int8", lambda: QuantSpec(format="int8", granularity=PerChannel(0)), lambda: QuantSpec(format="int8"),
      "int8 weights per output channel, int8 inputs with static per-tensor scales (needs --calib)")
_w8a8("w8a8-int8-dynamic", lambda: QuantSpec(format="int8", granularity=PerChannel(0), symmetric_range="restricted"),
      lambda: QuantSpec(format="int8", granularity=PerChannel(0), dynamic=True, symmetric=False),
      "int8 weights per output channel ([-127, 127]), int8 inputs with dynamic per-token scales and zero points")
_w8a8("w8a8-int8-pot", lambda: QuantSpec(format="int8", power_of_two=True),
      lambda: QuantSpec(format="int8", power_of_two=True),
      "int8 weights and inputs, static per-tensor power-of-two scales (NPU style: a scale is a shift; needs --calib)")
register_preset("w8a8-int8-sq", lambda: Preset("w8a8-int8-sq", linear_recipe(
    QuantSpec(format="int8", granularity=PerChannel(0)), Step("smoothquant", alpha="auto"), input=QuantSpec(format="int8")),
    "w8a8-int8 after SmoothQuant with alpha searched per layer (auto-SmoothQuant; needs --calib)"))
_w8a8("fp8-w8a8", lambda: QuantSpec(format="fp8_e4m3", granularity=PerChannel(0)),
      lambda: QuantSpec(format="fp8_e4m3"),
      "fp8 e4m3 weights per output channel (scales by the MSE observer), fp8 inputs with static per-tensor scales "
      "(needs --calib)", Step("rtn", observer="mse"))


def _gptq_spec(bits: int, group: int) -> QuantSpec:
    return QuantSpec(format=f"uint{bits}", granularity=PerGroup(group), symmetric=False, pad=True)


for _b, _g in ((4, 128), (4, 64), (3, 64)):
    _builtin(f"gptq{_b}-g{_g}", lambda b=_b, g=_g: _gptq_spec(b, g),
             f"GPTQ uint{_b} asymmetric (integer zero point), group {_g}, static act-order (needs --calib)",
             Step("gptq"))
for _b, _g in ((4, 128), (4, 64), (3, 64)):
    _builtin(f"awq{_b}-g{_g}", lambda b=_b, g=_g: _gptq_spec(b, g),
             f"AWQ uint{_b} asymmetric (integer zero point), group {_g}: activation-aware scales and clipping "
             "(needs --calib)", Step("awq"))
for _b, _g in ((4, 128), (3, 64), (2, 64)):
    _builtin(f"signround{_b}-g{_g}", lambda b=_b, g=_g: _gptq_spec(b, g),
             f"SignRound (AutoRound) uint{_b} asymmetric (integer zero point), group {_g}: rounding and clipping "
             "learned by signed gradient descent, 200 iterations per block (needs --calib)", Step("signround"))
for _b, _g in ((4, 128), (3, 64), (2, 64)):
    _builtin(f"qat{_b}-g{_g}", lambda b=_b, g=_g: _gptq_spec(b, g),
             f"quantization-aware training block by block (Block-AP) from GPTAQ's solution, uint{_b} asymmetric "
             f"(integer zero point), group {_g}: each block's weights and ranges trained with Adam against the float "
             "block's output (needs --calib)", Step("qat", init="gptaq"))
_builtin("awq-gptq4-g128", lambda: _gptq_spec(4, 128),
         "AWQ scales, then GPTQ: uint4 asymmetric (integer zero point), group 128 (needs --calib)",
         Step("awq", clip=False), Step("gptq"))
register_preset("gptq-w8a8", lambda: Preset("gptq-w8a8", linear_recipe(
    QuantSpec(format="int8", granularity=PerChannel(0)), Step("smoothquant", alpha="auto"), Step("gptq"),
    input=QuantSpec(format="int8")),
    "auto-SmoothQuant, then GPTQ int8 weights per output channel, int8 static per-tensor inputs (needs --calib)"))

register_preset("fp8-w8a8-kv", lambda: Preset(
    "fp8-w8a8-kv", Recipe(type_rules={t: QuantSpec(format="fp8_e4m3", granularity=PerChannel(0)) for t in LINEAR_TYPES},
                          exclude=DEFAULT_EXCLUDE, input=QuantSpec(format="fp8_e4m3"),
                          kv_cache=QuantSpec(format="fp8_e4m3"), steps=[Step("rtn", observer="mse")]),
    "fp8-w8a8 with an fp8 e4m3 key/value cache (static per-tensor k_scale/v_scale on the cached keys and values; "
    "weight scales by the MSE observer, which bench/bench_w8a8_quality.py finds better than min/max; needs --calib)"))



def _rotated(name: str, first: str, acts: int, description: str) -> None:
    register_preset(name, lambda: Preset(name, Recipe(
        type_rules={t: QuantSpec(format="int4", granularity=PerChannel(0)) for t in LINEAR_TYPES},
        exclude=DEFAULT_EXCLUDE, input=QuantSpec(format=f"int{acts}", granularity=PerChannel(0), dynamic=True),
        steps=[Step(first), Step("gptq")]), description))


for _a in (8, 4):
    _rotated(f"quarot-w4a{_a}", "rotate", _a,
             f"QuaRot + GPTQ: rotated residual stream and heads, online Hadamard before the down projections; int4 "
             f"weights per output channel, int{_a} dynamic per-token inputs (Llama, Mistral, Qwen2, Phi-3; needs --calib)")
    _rotated(f"spinquant-w4a{_a}", "spinquant", _a,
             f"SpinQuant + GPTQ: the rotations learned on the quantized model's loss (100 Cayley SGD iterations), "
             f"then as quarot-w4a{_a} (Llama, Mistral, Qwen2, Phi-3; needs --calib)")


def presets() -> dict[str, Preset]:
    """Every preset whose format is registered, by name."""
    out = {}
    for name, make in PRESETS.items():
        try:
            preset = make()
        except (ValueError, TypeError) as e:
            if getattr(e, "unknown", (None,))[0] == "format":  # its format is not registered here
                continue
            raise type(e)(f"preset {name!r}: {e}") from e
        if not isinstance(preset, Preset):
            raise TypeError(f"preset {name!r}: its function returned {type(preset).__name__}, not a qtransform.Preset")
        out[name] = preset
    return out


def get_preset(name: str) -> Preset:
    """The preset ``name``, with a clear error listing the presets."""
    if not isinstance(name, str):
        raise TypeError(f"recipe must be a preset name (str), got {type(name).__name__}")
    table = presets()
    if name not in table:
        raise ValueError(f"unknown recipe {name!r}; presets: {', '.join(table)}")
    return table[name]


