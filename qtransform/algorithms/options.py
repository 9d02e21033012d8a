"""A step's options as a type: a frozen keyword-only dataclass per algorithm, one checker for all.

Each field is an option: its annotation says the type (``bool``, ``int``, ``float``, ``str``, ``list``,
``dict``, ``Any``, or a union of them with ``None``), its default the default, and :func:`option`'s
metadata the range (``ge``, ``gt``, ``le``, ``lt``) or the ``choices``. :func:`check_options` validates
names, types and ranges the same way for every algorithm, then builds the dataclass, whose
``__post_init__`` checks what spans several options (raising ``ValueError``/``TypeError`` with the option's
name first); every message is prefixed by the tree path, when given, and the step's name. The step receives
the built instance (``fn(..., options=...)``) and reads its fields; :func:`received` checks one handed to it.

Types: a ``bool`` is not an ``int`` (``True`` is no block size), an ``int`` is a ``float``; a ``list``
field takes a list or a tuple, a ``dict`` field any mapping. Floats must be finite unless the field
says ``inf=True``; NaN fails every range.

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True, kw_only=True)
... class Demo:
...     iters: int = option(20, ge=0)
...     mode: str = option("fast", choices=("fast", "exact"))
>>> check_options(Demo, {"iters": 5}, step="demo")
Demo(iters=5, mode='fast')
>>> check_options(Demo, {"iters": True}, step="demo", path="recipe.steps[0] (demo)")
Traceback (most recent call last):
...
TypeError: recipe.steps[0] (demo): demo: iters must be an int >= 0, got True
>>> option_fields(Demo)
[('iters', 'int', 20), ('mode', 'str', 'fast')]
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Mapping

from .._checks import where

__all__ = ["option", "check_options", "received", "option_fields", "options_checker"]

_RANGE = ("ge", "gt", "le", "lt")


def option(default: Any = None, *, ge=None, gt=None, le=None, lt=None, choices=None, inf: bool = False,
           expect: str | None = None, doc: str = "") -> Any:
    """A dataclass field for an option: its ``default``, its range (``ge``/``gt``/``le``/``lt``), or the
    ``choices`` it takes; ``inf=True`` lets a float be infinite; ``expect`` says in words what it must be
    where the type and range do not say it all (the rest is checked in ``__post_init__``); ``doc`` a short
    description."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt).items() if v is not None}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if expect is not None:
        meta["expect"] = expect
    meta.update(inf=inf, doc=doc)
    return dataclasses.field(default=default, metadata=meta)


def _kinds(tp) -> tuple[tuple, bool]:
    """The base types an annotation allows and whether it allows None."""
    if tp is Any:
        return (), True
    origin = typing.get_origin(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        kinds, none = [], False
        for arg in typing.get_args(tp):
            if arg is type(None):
                none = True
            else:
                k, n = _kinds(arg)
                if not k:
                    return (), True
                kinds += k
                none = none or n
        return tuple(kinds), none
    return ((origin or tp),), False


_NAMES = {bool: "true or false", int: "an int", float: "a number", str: "a string", list: "a list", dict: "a table"}


def _fits(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, (list, tuple))
    if kind is dict:
        return isinstance(value, Mapping)
    return isinstance(value, kind)


def _expect(kinds, none: bool, meta: Mapping) -> str:
    """What an option must be, in words: ``an int >= 1``, ``a number in [0, 1)``, ``one of [...]``."""
    if "expect" in meta:
        return meta["expect"]
    if "choices" in meta:
        what = f"one of {list(meta['choices'])}"
    else:
        what = " or ".join(_NAMES.get(k, k.__name__) for k in kinds) or "a value"
        lo = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
        hi = ("]", meta["le"]) if "le" in meta else (")", meta["lt"]) if "lt" in meta else None
        if lo and hi:
            what += f" in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
        elif lo:
            what += f" {'>=' if lo[0] == '[' else '>'} {lo[1]}"
        elif hi:
            what += f" {'<=' if hi[0] == ']' else '<'} {hi[1]}"
    return what + (" or null" if none else "")


def _in_range(value, meta: Mapping) -> bool:
    if "choices" in meta:
        return value in meta["choices"]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return True
    if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not meta.get("inf"))):
        return False
    return (("ge" not in meta or value >= meta["ge"]) and ("gt" not in meta or value > meta["gt"])
            and ("le" not in meta or value <= meta["le"]) and ("lt" not in meta or value < meta["lt"]))


def _hints(cls) -> dict:
    hints = getattr(cls, "__qt_hints__", None)
    if hints is None or hints[0] is not cls:
        hints = (cls, typing.get_type_hints(cls))
        cls.__qt_hints__ = hints
    return hints[1]


def check_options(cls, options: Mapping[str, Any], *, step: str, path: str | None = None):
    """``cls(**options)`` after checking every option's name, type and range (see the module docstring).

    ``ValueError`` for an unknown name (listing the known ones) or a value out of range, ``TypeError`` for
    a wrong type; the message starts with ``path`` (when given) and ``step``.
    """
    prefix = f"{where(path)}{step}: "
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise TypeError(f"{prefix}options must map option names to values, got {options!r:.80}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"{prefix}unknown option(s) {unknown}; known: {list(fields)}")
    hints = _hints(cls)
    for name, value in options.items():
        kinds, none = _kinds(hints[name])
        meta = fields[name].metadata
        if value is None and none:
            continue
        if kinds and not any(_fits(value, k) for k in kinds):
            raise TypeError(f"{prefix}{name} must be {_expect(kinds, none, meta)}, got {value!r:.80}")
        if not _in_range(value, meta):
            raise ValueError(f"{prefix}{name} must be {_expect(kinds, none, meta)}, got {value!r:.80}")
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{prefix}{e}") from None


def _type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def received(cls, options, *, step: str):
    """``options`` as a step receives it (``fn(params, plan, *, context, options)``): an instance of ``cls``,
    else ``TypeError`` naming ``options``; its fields are checked as :func:`check_options` checks a mapping
    (an instance built directly has not had its types and ranges checked). Returns ``options``.

    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True, kw_only=True)
    ... class Demo:
    ...     iters: int = option(20, ge=0)
    >>> received(Demo, Demo(iters=3), step="demo")
    Demo(iters=3)
    >>> received(Demo, Demo(iters=-1), step="demo")
    Traceback (most recent call last):
    ...
    ValueError: demo: iters must be an int >= 0, got -1
    >>> received(Demo, {"iters": 3}, step="demo")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: demo: options must be an instance of ...Demo (the step's options dataclass), got dict
    """
    if not isinstance(options, cls):
        raise TypeError(f"{step}: options must be an instance of {_type_name(cls)} (the step's options dataclass), "
                        f"got {_type_name(type(options))}")
    check_options(cls, {f.name: getattr(options, f.name) for f in dataclasses.fields(cls)}, step=step)
    return options


def options_checker(step: str, cls):
    """``check(*, path=None, **options) -> cls instance``: :func:`check_options` for one algorithm (the
    ``check_options`` function of a step module)."""

    def check(*, path: str | None = None, **options):
        return check_options(cls, options, step=step, path=path)

    check.__doc__ = f"The options of ``{step}`` checked and built: ``{cls.__name__}`` (see its fields)."
    return check


def option_fields(cls) -> list[tuple[str, str, Any]]:
    """``[(name, type, default)]`` of an options dataclass, for listings (``qtransform recipes``)."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        kinds, none = _kinds(tp)
        label = " | ".join(k.__name__ for k in kinds) or "any"
        out.append((f.name, label + (" | None" if none and kinds else ""), f.default))
    return out
