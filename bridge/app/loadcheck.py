"""Guards before transformers loads a model directory for the command.

A Quark, compressed-tensors or qtransform export whose ``config.json`` lost its
``quantization_config`` would load as a float model: fp8 or integer codes used as weights, their
scales dropped (transformers reports them as unexpected and goes on). :func:`check_quantized_without_config`
reads the safetensors headers only (no tensor data) and refuses such a directory, naming the tensor.

>>> quantized_looking({"model.layers.0.mlp.up_proj.weight_scale": {"dtype": "F16", "shape": [8]}})
'model.layers.0.mlp.up_proj.weight_scale'
>>> quantized_looking({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [8, 4]}}) is None
True
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..checkpoint import CheckpointError

__all__ = ["QUANTIZED_SUFFIXES", "QUANTIZED_DTYPES", "quantized_looking", "check_quantized_without_config"]

#: Tensor-name endings that only quantized checkpoints hold (Quark, compressed-tensors, qtransform).
QUANTIZED_SUFFIXES = ("weight_scale", "weight_zero_point", "weight_packed", "weight_shape", "weight_global_scale",
                      "weight_g_idx", "input_scale", "input_zero_point", "output_scale", "output_zero_point")
#: safetensors dtypes no float checkpoint stores its weights in (fp8 codes, packed integers).
QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I32", "U8", "I8", "U32", "I16", "U16")
_MAX_HEADER = 100 * 1024 * 1024


def quantized_looking(header: dict) -> str | None:
    """The first tensor name (sorted) of a safetensors ``header`` that looks quantized: a quantized-only
    last name component (``x.weight_scale``, not Gemma-3n's ``altup.correct_output_scale``), or a ``.weight`` stored
    as fp8 or integer codes; ``None`` when none does."""
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name] if isinstance(header[name], dict) else {}
        if name.rpartition(".")[2] in QUANTIZED_SUFFIXES or (name.endswith(".weight") and info.get("dtype") in QUANTIZED_DTYPES):
            return name
    return None


def _header(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):  # unreadable: loading names the problem
        return None
    return header if isinstance(header, dict) else None


def check_quantized_without_config(source) -> None:
    """Refuse (:class:`~bridge.CheckpointError`, naming the file and the tensor) a transformers directory
    (a :class:`~bridge.app.models.ModelSource`) whose ``config.json`` has no ``quantization_config``
    but whose safetensors files hold quantized-looking tensors; GGUF sources pass."""
    if source.gguf_file is not None:
        return
    directory = Path(source.directory)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return  # loading reports it
    if not isinstance(config, dict) or config.get("quantization_config") is not None:
        return
    for path in sorted(directory.glob("*.safetensors")):
        header = _header(path)
        name = quantized_looking(header) if header is not None else None
        if name is not None:
            dtype = header[name].get("dtype") if isinstance(header[name], dict) else "?"
            raise CheckpointError(f"{path}: tensor {name!r} ({dtype}) is quantized but config.json has no "
                                  "quantization_config (removed?); loading it as a float model would use its codes "
                                  "unscaled")
