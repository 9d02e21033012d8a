"""Path-aware helpers over parameter trees.

This is the only module that imports ``torch.utils._pytree``. A *path* is the
dotted string that names a leaf: a flat state dict ``{"model.w": t}`` gives
``"model.w"``; a nested ``{"model": {"w": t}}`` gives the same ``"model.w"``;
list indices appear as numbers (``"layers.0.w"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch.utils._pytree as _pytree

__all__ = ["register_node", "pytree_dataclass", "flatten_with_paths", "map_with_path", "tree_map",
           "tree_leaves"]


def register_node(cls: type, flatten: Callable, unflatten: Callable) -> None:
    """Register ``cls`` as a pytree node (tensor children, hashable static context)."""
    _pytree.register_pytree_node(
        cls, flatten, unflatten, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}"
    )


def pytree_dataclass(*, static: tuple[str, ...]):
    """Make a frozen keyword-only dataclass whose ``static`` fields are pytree context.

    Tensor fields are leaves; fields that are ``None`` are absent from the leaves, so
    ``torch.func.vmap``, ``grad`` and ``tree_map`` see tensors only.
    """

    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        names = tuple(f.name for f in dataclasses.fields(cls))
        data = tuple(n for n in names if n not in static)

        def flatten(obj):
            present = tuple(n for n in data if getattr(obj, n) is not None)
            ctx = (tuple(getattr(obj, n) for n in static), present)
            return [getattr(obj, n) for n in present], ctx

        def unflatten(children, ctx):
            static_vals, present = ctx
            kwargs = dict(zip(static, static_vals))
            kwargs.update({n: None for n in data})
            kwargs.update(zip(present, children))
            obj = object.__new__(cls)
            for k, v in kwargs.items():
                object.__setattr__(obj, k, v)
            return obj

        register_node(cls, flatten, unflatten)
        return cls

    return wrap


def _key_str(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_str(key_path: tuple) -> str:
    """Join a pytree key path into the dotted form used everywhere in qtransform."""
    return ".".join(_key_str(k) for k in key_path)


def flatten_with_paths(tree: Any, *, is_leaf: Callable[[Any], bool] | None = None):
    """Return ``([(path, leaf), ...], treespec)``."""
    pairs, spec = _pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_str(kp), leaf) for kp, leaf in pairs], spec


def map_with_path(fn: Callable[[str, Any], Any], tree: Any, *, is_leaf=None) -> Any:
    """Apply ``fn(path, leaf)`` to every leaf and rebuild the tree (inputs are not modified)."""
    pairs, spec = flatten_with_paths(tree, is_leaf=is_leaf)
    return _pytree.tree_unflatten([fn(p, leaf) for p, leaf in pairs], spec)


def tree_map(fn: Callable, tree: Any, *, is_leaf=None) -> Any:
    return _pytree.tree_map(fn, tree, is_leaf=is_leaf)


def tree_leaves(tree: Any, *, is_leaf=None) -> list:
    return _pytree.tree_leaves(tree, is_leaf=is_leaf)
