"""``Step``: one step of a recipe, a registered algorithm's name with its options.

A recipe's steps run in order (:func:`qtransform.run_steps`): ``["smoothquant", "gptq"]``,
``[Step("hqq", error_norm=4)]``. A step is plain data: hashable, JSON round-trippable, and
checked against the algorithm registry where it runs (and where recipe files are read), so
that ``qtransform.spec`` stays below the algorithms in the import order.

>>> import qtransform as qt
>>> s = qt.Step("hqq", error_norm=4, refine_scale=False)
>>> s
Step('hqq', error_norm=4, refine_scale=False)
>>> s.to_dict()
{'name': 'hqq', 'options': {'error_norm': 4, 'refine_scale': False}}
>>> qt.Step.from_value(s.to_dict()) == s, qt.Step.from_value("rtn")
(True, Step('rtn'))
"""

from __future__ import annotations

import json
import types
from typing import Any, Mapping

__all__ = ["Step"]


class Step:
    """An algorithm name and its keyword options (JSON-able values).

    Args:
        name: a name of :data:`qtransform.algorithms.ALGORITHMS` (checked where the step runs).
        **options: keyword options of that algorithm.
    """

    __slots__ = ("name", "_options", "_key")

    def __init__(self, name: str, /, **options: Any):
        if not isinstance(name, str) or not name:
            raise TypeError(f"Step: name must be a non-empty string (an algorithm name), got {name!r}")
        try:
            text = json.dumps(options, sort_keys=True, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"Step {name!r}: options must be JSON-able (numbers, strings, bools, None, "
                            f"lists and dicts of those): {e}") from None
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_options", types.MappingProxyType(json.loads(text)))
        object.__setattr__(self, "_key", (name, text))

    @property
    def options(self) -> Mapping[str, Any]:
        """The options (read-only)."""
        return self._options

    def __setattr__(self, key, value):
        raise AttributeError("Step is immutable")

    def __reduce__(self):  # copy, deepcopy and pickle rebuild through __init__
        return _step, (self.name, dict(self._options))

    def __eq__(self, other) -> bool:
        return isinstance(other, Step) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self._options.items())
        return f"Step({self.name!r}{opts})"

    def to_dict(self) -> dict:
        return {"name": self.name, "options": dict(self._options)}

    @classmethod
    def from_value(cls, value, *, where: str = "step") -> "Step":
        """A step from a :class:`Step`, an algorithm name, or ``{"name": ..., "options": {...}}``
        (the options may also sit beside ``name``: ``{"name": "hqq", "error_norm": 4}``)."""
        if isinstance(value, Step):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping):
            d = dict(value)
            name = d.pop("name", None)
            if not isinstance(name, str):
                raise ValueError(f"{where}: needs a 'name' (an algorithm name), got {value!r}")
            options = d.pop("options", {})
            if not isinstance(options, Mapping):
                raise TypeError(f"{where}: 'options' must be a table/object, got {type(options).__name__}")
            clash = sorted(set(d) & set(options))
            if clash:
                raise ValueError(f"{where}: option(s) {clash} given twice")
            return cls(name, **{**dict(options), **d})
        raise TypeError(f"{where}: expected an algorithm name, a Step or a {{'name': ..., 'options': ...}} "
                        f"table, got {type(value).__name__}")


def _step(name: str, options: dict) -> Step:
    return Step(name, **options)
