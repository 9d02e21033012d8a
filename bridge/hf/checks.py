"""What ``from_pretrained`` checks in a qtransform checkpoint before transformers reads any data.

transformers loads whatever the files hold into whatever the model has: a missing tensor is
initialised at random, an unexpected one dropped with a warning, a tensor of another dtype cast.
For a qtransform checkpoint each of these is a corrupted or edited file that would load silently
wrong, so :func:`check_checkpoint` compares the shard headers with the skeleton the quantizer
built (names, shapes, dtypes; quantized parts exactly, plain floating tensors in any floating
dtype since transformers casts those on purpose) and then verifies the checksums written with
every tensor (:mod:`bridge.checkpoint.checksum`; ``QTransformConfig(verify=False)`` passed to
``from_pretrained`` skips that). Everything raises :class:`~bridge.checkpoint.metadata.CheckpointError`
naming the file and tensor.

:func:`patch_transformers_loader` adds two guards to transformers' loader: a checkpoint whose shards say they were
written by qtransform cannot be loaded without its quantization config (``quantization_config``
deleted or set to null in ``config.json`` would load codes as float weights), and the float8
*fnuz* dtypes get their safetensors names so fp8 fnuz checkpoints load like every other format.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import modeling_utils
from transformers.quantizers import auto as hf_auto

from ..checkpoint import checksum, metadata
from ..checkpoint.layout import LAYOUTS
from ..checkpoint.metadata import CheckpointError
from ..checkpoint.store import FLOAT_DTYPES, ST_DTYPES
from ..tree import site_buffers

__all__ = ["check_checkpoint", "written_by_qtransform", "patch_transformers_loader"]

_FNUZ = {"F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz}


def _headers(files) -> dict[str, tuple[Path, dict]]:
    """``{tensor name: (file, header entry)}`` of the shards (headers only, no data)."""
    out = {}
    for f in files:
        path = Path(f)
        header, _ = checksum.read_header(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if name in out:
                raise CheckpointError(f"{path}: tensor {name!r} is also stored in {out[name][0]}")
            out[name] = (path, entry)
    return out


def _matches(name: str, patterns) -> bool:
    return any(re.search(p, name) for p in patterns or ())


def _strict_names(model) -> bool:
    """Whether checkpoint names must equal the model's: no weight renaming registered for it
    (transformers renames keys of some architectures, e.g. fused experts, as it loads)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        return not get_model_conversion_mapping(model, add_legacy=False)
    except (ImportError, TypeError):
        return True


def check_checkpoint(model, cfg, files, *, verify: bool = True) -> None:
    """Check the shards ``files`` against ``model`` (quantized skeleton on ``meta``) and its
    ``cfg`` (:class:`~bridge.hf.config.QTransformConfig` of the checkpoint); see the module docstring."""
    files = [f for f in files or () if str(f).endswith(".safetensors")]
    if not files:
        return
    stored = _headers(files)
    layout = LAYOUTS[cfg.layout]
    exact = {}
    for path, e in cfg.entries.items():
        exact.update(layout.expected(path, e.spec, e.shape, e.dtype))
    for site, spec in getattr(cfg, "activations", {}).items():  # static quantizers: buffers on the skeleton
        exact.update({k: (tuple(b.shape), b.dtype) for k, b in site_buffers(model, site).items()})
    plain = {n: t for n, t in model.state_dict().items() if n not in exact}
    tied = {**(getattr(model, "all_tied_weights_keys", None) or {}), **cfg.aliases}
    strict = _strict_names(model)
    missing = [n for n in exact if n not in stored]
    if strict:
        missing += [n for n in plain if n not in stored and not (tied.get(n) in stored)
                    and not _matches(n, getattr(model, "_keys_to_ignore_on_load_missing", None))]
    if missing:
        where = files[0] if len(files) == 1 else Path(files[0]).parent
        raise CheckpointError(f"{where}: missing tensor(s) {sorted(missing)[:5]}" + (" ..." if len(missing) > 5 else "")
                              + " (deleted or renamed; transformers would initialise them at random)")
    if strict:
        extra = [n for n in stored if n not in exact and n not in plain and n not in getattr(cfg, "carried", ())
                 and not _matches(n, getattr(model, "_keys_to_ignore_on_load_unexpected", None))]
        if extra:
            raise CheckpointError(f"{stored[extra[0]][0]}: unexpected tensor(s) {sorted(extra)[:5]} (not in the "
                                  "model or its quantization_config: renamed, or the config was edited)")
    for name, (file, entry) in stored.items():
        if name in exact:
            shape, dtype = exact[name]
            ok_dtype = entry.get("dtype") == ST_DTYPES.get(dtype)
        elif name in plain:
            shape, dtype = tuple(plain[name].shape), plain[name].dtype
            allowed = FLOAT_DTYPES if dtype.is_floating_point else (dtype,)
            ok_dtype = entry.get("dtype") in {ST_DTYPES[d] for d in allowed if d in ST_DTYPES}
        else:
            continue
        if tuple(entry.get("shape", ())) != tuple(shape) or not ok_dtype:
            want = ST_DTYPES.get(dtype, str(dtype)) if name in exact or not dtype.is_floating_point else "a float dtype"
            raise CheckpointError(f"{file}: tensor {name!r} has shape {entry.get('shape')} and dtype "
                                  f"{entry.get('dtype')}, expected {list(shape)} and {want}")
    if verify:
        checksum.verify_files(files)


def written_by_qtransform(files) -> Path | None:
    """The first safetensors shard of ``files`` whose metadata says qtransform wrote it (headers only)."""
    for f in files or ():
        if str(f).endswith(".safetensors") and Path(f).is_file():
            header, _ = checksum.read_header(Path(f))
            if (header.get("__metadata__") or {}).get("quant_method") == metadata.QUANT_METHOD:
                return Path(f)
    return None


def _guarded(get_dtype):
    def _get_dtype(dtype, checkpoint_files, config, *args, **kwargs):
        quantizer = kwargs.get("hf_quantizer", args[3] if len(args) > 3 else None)
        if getattr(quantizer, "quantization_config", None) is None or \
                getattr(quantizer.quantization_config, "quant_method", None) != metadata.QUANT_METHOD:
            shard = written_by_qtransform(checkpoint_files)
            if shard is not None:
                raise CheckpointError(
                    f"{shard}: holds quantized tensors written by qtransform, but config.json has no "
                    "quantization_config with quant_method 'qtransform' (deleted or edited): loading would read "
                    "the codes as float weights")
        return get_dtype(dtype, checkpoint_files, config, *args, **kwargs)

    _get_dtype.__wrapped__ = get_dtype
    _get_dtype._qtransform_guard = True
    return _get_dtype


def patch_transformers_loader(config_class) -> None:
    """Add the guards to transformers' loader (idempotent; see the module docstring)."""
    # each guard only where this transformers has the hook (tests/bridge/checkpoint show a missing one)
    names = getattr(modeling_utils, "str_to_torch_dtype", None)
    if isinstance(names, dict):
        for name, dtype in _FNUZ.items():
            names.setdefault(name, dtype)
    get_dtype = getattr(modeling_utils, "_get_dtype", None)
    if callable(get_dtype) and not getattr(get_dtype, "_qtransform_guard", False):
        modeling_utils._get_dtype = _guarded(get_dtype)
    types = getattr(hf_auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if isinstance(types, tuple) and config_class not in types:  # so that from_pretrained(..., quantization_config=QTransformConfig(verify=False)) applies
        hf_auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*types, config_class)
