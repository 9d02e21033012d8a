"""Validation at the door: clear ``TypeError``/``ValueError`` messages, never ``assert``.

NaN/Inf policy (the same for every format): a tensor that is observed or quantized
must be finite. A NaN or an infinity raises ``ValueError`` naming the argument,
how many values are non-finite and the first offending index. Values checks need
the data, so they run eagerly; inside ``torch.func.vmap`` and while
``torch.compile`` traces they are skipped (data-dependent errors cannot be raised
there) and non-finite values then propagate as NaN. :func:`data_checks` turns them off for a
block of code the same way: on a GPU each such check is a host synchronisation, which a quantized
model's forward (a dynamic activation quantizer per linear) cannot afford.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["check_float_tensor", "check_finite", "where", "under_transform", "data_checks"]

_CHECKS = [True]  # one flag per process (a plain global: torch.compile reads it): data_checks() sets it for its block


@contextlib.contextmanager
def data_checks(enabled: bool):
    """Turn the data-dependent value checks (NaN/Inf, scale overflow) on or off inside the block; type and
    shape checks stay. Off, non-finite values propagate as NaN, as under ``vmap``.

    >>> import qtransform as qt
    >>> with qt.data_checks(False):
    ...     qp = qt.choose_qparams(torch.tensor([1.0, float("nan")]), qt.QuantSpec(format="int8"))
    >>> bool(qp.scale.isnan().any())
    True
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"data_checks: enabled must be a bool, got {type(enabled).__name__}")
    before = _CHECKS[0]
    _CHECKS[0] = enabled
    try:
        yield
    finally:
        _CHECKS[0] = before


def where(path: str | None) -> str:
    """Prefix for error messages that carry a tree path."""
    return f"{path}: " if path else ""


def _is_batched(x: torch.Tensor) -> bool:
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(x):
        if f.is_batchedtensor(x):
            return True
        x = f.get_unwrapped(x)
    return False


def differentiated(t) -> bool:
    """Whether ``t`` is being differentiated: ``requires_grad`` with grad mode on (autograd, ``torch.func.grad``),
    or a dual tensor of forward mode (``torch.func.jvp``, ``jacfwd``: no ``requires_grad`` there)."""
    if t is None:
        return False
    if t.requires_grad and torch.is_grad_enabled():
        return True
    return _has_tangent(t)


def func_differentiated(t) -> bool:
    """Whether ``torch.func`` differentiates ``t``: a tensor ``grad`` / ``vjp`` track (not one detached there), or
    a dual tensor of forward mode (``jvp``, ``jacfwd``). ``False`` while ``torch.compile`` traces."""
    if t is None or torch.compiler.is_compiling():
        return False
    if t.requires_grad and torch._C._functorch.is_functorch_wrapped_tensor(t):
        return True
    return _has_tangent(t)


def _has_tangent(t) -> bool:
    if torch.compiler.is_compiling():
        return False
    try:
        return torch.autograd.forward_ad.unpack_dual(t).tangent is not None
    except RuntimeError:  # no forward-mode level open
        return False


def under_transform(x: torch.Tensor) -> bool:
    """True inside ``vmap`` or while ``torch.compile`` traces: no data-dependent checks there."""
    return not _CHECKS[0] or torch.compiler.is_compiling() or _is_batched(x)


def check_float_tensor(x, *, name: str = "x", path: str | None = None) -> torch.Tensor:
    """Type and shape checks that need no data: a non-empty real floating tensor with ndim >= 1."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where(path)}{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex() or not x.is_floating_point():
        raise TypeError(
            f"{where(path)}{name} must be a real floating-point tensor, got dtype {x.dtype}"
        )
    if x.dim() == 0:
        raise ValueError(f"{where(path)}{name} must have at least one dimension, got a 0-d tensor")
    if x.numel() == 0:
        raise ValueError(f"{where(path)}{name} is empty (shape {tuple(x.shape)})")
    return x


def check_finite(x: torch.Tensor, *, name: str = "x", path: str | None = None) -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or Inf (skipped under vmap/compile)."""
    if under_transform(x):
        return
    if bool(torch.isfinite(x.detach().sum(dtype=torch.float32))):  # one cheap pass; NaN/Inf propagate
        return
    finite = torch.isfinite(x.detach())
    if bool(finite.all()):
        return
    bad = (~finite).nonzero()
    first = tuple(int(i) for i in bad[0])
    value = x.detach()[first].item()
    raise ValueError(
        f"{where(path)}{name} of shape {tuple(x.shape)} holds {bad.shape[0]} non-finite "
        f"value(s) (first {value} at index {first}); qtransform quantizes finite data only"
    )
