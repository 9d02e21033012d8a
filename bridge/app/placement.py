"""The options and helpers both drivers of ``qtransform quantize`` share (:mod:`bridge.app.driver` picks one):
``--stream`` / ``--in-memory``, ``--device`` (where the work runs; the checkpoint is written from the host),
``--dtype`` (the dtype the float tensors of every quantized checkpoint are stored in; default: as in the
input), the stored dtypes and size (the report's "before"), ``--resume`` and ``--max-memory`` (streamed only,
:mod:`bridge.app.streaming`), ``--no-memory-check`` and ``--layer-errors``.
"""

from __future__ import annotations

import argparse

from .inputs import UserError

__all__ = ["add_options", "check_run_options", "run_device", "to_host", "dtype_of", "stored_dtypes", "stored_size",
           "source_refusal"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_options(q) -> None:
    how = q.add_mutually_exclusive_group()
    how.add_argument("--stream", action="store_true",
                     help="insist on quantizing shard to shard (steps without data) or block by block (calibrated "
                          "steps), never holding the whole model: the default for a checkpoint directory of "
                          "safetensors shards; with --stream a run that cannot stream is an error")
    how.add_argument("--in-memory", action="store_true",
                     help="load the whole model and quantize it in memory (the default for a GGUF file, another "
                          "tool's checkpoint and what streaming refuses)")
    q.add_argument("--resume", action="store_true", help="continue an interrupted streamed run of the same command")
    q.add_argument("--device", help="where the quantization runs (cpu, cuda, cuda:1...; default cpu): in memory the whole "
                                    "model is moved there from the host for the steps and the perplexities, and the "
                                    "checkpoint is written from the host as on the CPU (the same format; values "
                                    "equal to a CPU run's but at rounding near-ties); streamed only the block "
                                    "being calibrated is there")
    q.add_argument("--max-memory", metavar="SIZE",
                   help="streamed: calibration activations kept in memory (e.g. 4GB); beyond, they spill to disk")
    q.add_argument("--no-memory-check", action="store_true",
                   help="run even when the estimated peak memory exceeds what the machine has available")
    q.add_argument("--layer-errors", action=argparse.BooleanOptionalAction, default=True,
                   help="measure each quantized tensor's relative error for the report (default; it costs about as "
                        "much as round-to-nearest itself: --no-layer-errors skips it)")
    q.add_argument("--dtype", choices=_DTYPES, default="auto",
                   help="dtype of the checkpoint's float tensors (default auto: as stored in the input)")


def check_device(a) -> None:
    """``--device`` names a device this machine has (before anything is loaded)."""
    if a.device:
        import torch

        try:
            dev = torch.device(a.device)
        except (RuntimeError, ValueError):
            raise UserError(f"--device {a.device!r} is not a device (cpu, cuda, cuda:1...)") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {a.device}: no CUDA device is available here")


def check_run_options(a) -> None:
    """The device and memory options are well formed (before anything is loaded; which driver takes
    ``--resume`` and ``--max-memory`` is :func:`bridge.app.driver.choose_driver`'s)."""
    from ..checkpoint.store import parse_size

    check_device(a)
    if a.max_memory:
        try:
            parse_size(a.max_memory)
        except (TypeError, ValueError) as e:
            raise UserError(f"--max-memory {a.max_memory!r}: {e}") from None


def run_device(a):
    """The ``torch.device`` of ``--device`` for the in-memory run, ``None`` without it (``cpu``: the same moves,
    none of which copies anything)."""
    if not a.device:
        return None
    import torch

    return torch.device(a.device)


def to_host(result, host=None):
    """``result`` (a :class:`bridge.tree.Quantized`) with every tensor on the host: each tensor moved once, so
    that a leaf of ``qtree`` that is a tensor of ``params`` stays that very tensor (``Quantized.changed``).
    ``host``: ``{path: tensor}`` already on the host for the tensors of ``result.params`` (the model moved back,
    ``bridge.extract(model)``): used instead of a second copy of the float model."""
    import torch
    import torch.utils._pytree as pytree

    moved: dict[int, torch.Tensor] = {}
    for p, t in (result.params or {}).items():
        h = (host or {}).get(p)
        if isinstance(t, torch.Tensor) and isinstance(h, torch.Tensor) and h.device.type == "cpu" and (
                h.shape, h.dtype) == (t.shape, t.dtype):
            moved[id(t)] = h

    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in moved:
            moved[id(t)] = t if t.device.type == "cpu" else t.detach().to("cpu")
        return moved[id(t)]

    # ``result`` keeps every tensor alive meanwhile: an id is never reused within the call
    return result._replace(**{f: pytree.tree_map(move, getattr(result, f))
                              for f in ("params", "qtree", "activations", "online")})


def dtype_of(a):
    import torch

    return "auto" if a.dtype == "auto" else getattr(torch, a.dtype)


def stored_dtypes(a, source, model, dtype=None):
    """``save(dtypes=...)`` of the in-memory run: the float tensors as stored in a safetensors input (``auto``),
    ``--dtype`` for all, or as loaded (``auto`` for a GGUF file or another tool's checkpoint); ``dtype``
    instead of ``--dtype`` when given (``"auto"``: as stored, the report's "before")."""
    dtype = dtype_of(a) if dtype is None else dtype
    if source_refusal(source) is not None:  # loaded by transformers or an importer: float tensors as loaded
        return None if dtype == "auto" else dtype
    from ..stream.driver import stored_dtypes_of
    from ..stream.source import Source

    return stored_dtypes_of(Source(source.directory), model, dtype)


def stored_size(source, params, dtypes) -> int:
    """The model's size as the input stores it (the report's "before"): its float tensors in their stored
    ``dtypes``; a GGUF file's own size; as loaded for another tool's checkpoint."""
    from .report import tree_bytes

    if source.gguf_file is not None and (source.directory / source.gguf_file).is_file():
        return (source.directory / source.gguf_file).stat().st_size
    return tree_bytes(params, dtypes)


def source_refusal(source) -> str | None:
    """Why ``source`` (a :class:`~bridge.app.models.ModelSource`) is not a float safetensors checkpoint directory,
    which a streamed run reads whatever the recipe (``None``: it is one)."""
    if source.gguf_file is not None:
        return f"{source.gguf_file} is a GGUF file (streaming reads a directory of safetensors shards)"
    if source.imported is not None:
        return f"it is a {source.imported} checkpoint (its values are dequantized first)"
    d = source.directory
    if not ((d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()):
        return "it holds no safetensors shards"
    return None
