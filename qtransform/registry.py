"""One registry helper for every registry: formats, observers, algorithms, presets (and the bridge's
kernels, checkpoint layouts and rebuild hooks).

A :class:`Registry` is a read-only mapping from names to items with one way to add an item
(:meth:`Registry.register`, refusing to overwrite unless ``replace=True``) and one error for an
unknown name, which lists the known ones (a ``ValueError`` whose ``unknown`` attribute is
``(kind, name)``).

>>> from qtransform.registry import Registry
>>> colours = Registry("colour")
>>> colours.register("red", (255, 0, 0))
(255, 0, 0)
>>> colours["red"], "blue" in colours, list(colours)
((255, 0, 0), False, ['red'])
>>> colours["blue"]
Traceback (most recent call last):
...
ValueError: unknown colour 'blue'; known: red
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

__all__ = ["Registry"]


class Registry(Mapping):
    """Names -> items. ``kind`` names what is registered, for error messages.

    Args:
        kind: what the items are (``"format"``, ``"algorithm"``...).
        check: optional ``check(name, item)`` that raises ``TypeError``/``ValueError`` for an
            item that does not belong here.
    """

    def __init__(self, kind: str, *, check: Callable[[str, Any], None] | None = None):
        self.kind = kind
        self._check = check
        self._items: dict[str, Any] = {}

    def register(self, name: str, item: Any, *, replace: bool = False) -> Any:
        """Add ``item`` under ``name``; returns ``item``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"register {self.kind}: name must be a non-empty string, got {name!r}")
        if self._check is not None:
            self._check(name, item)
        if name in self._items and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered (pass replace=True)")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> Any:
        """Remove ``name`` (tests that register an item for their own module only); returns the item."""
        return self._items.pop(self._known(name))

    def _known(self, name) -> str:
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} must be a name (str), got {type(name).__name__}")
        if name not in self._items:
            err = ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items))}")
            err.unknown = (self.kind, name)  # lets a caller tell "not registered" from other errors
            raise err
        return name

    def __getitem__(self, name: str) -> Any:
        return self._items[self._known(name)]

    def get(self, name, default=None):
        return self._items.get(name, default) if isinstance(name, str) else default

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self._items)})"
