"""Files of a checkpoint: safetensors shards written atomically and streamed, read with their headers
checked before any data.

Writing: :func:`atomic_directory` yields a temporary directory beside the target and renames it
into place only when everything inside was written (an existing target is replaced only with
``overwrite=True``), so a crash never leaves a half checkpoint under the target's name. The
directory and files get the usual permissions (``0777``/``0666`` less the umask). A save that was
killed leaves its temporary directory ``.NAME.tmp-HOST-PID-XXXXXXXX`` behind; the next save to
the same target removes it when it is stale: written on this host by a process that no longer
runs, or (another host, or a name without a process id) untouched for :data:`STALE_AFTER_S`
seconds. A live save's directory is never removed. A failure leaves nothing behind: not the
temporary directory, not the parent directories created for the target, and an existing target
that was to be replaced is put back. Whoever writes a directory of files (:func:`bridge.save`,
the exporters, the ``qtransform`` command with its report) writes it here.
:func:`write_shards` groups tensors into shards of at most ``max_shard_size`` bytes (a quantized
tensor's parts stay together) and copies each shard to the CPU only while it is written, so a
model on a GPU is never copied whole. Shards are written by :func:`write_safetensors`:
deterministic bytes (sorted header and metadata, no random order) with a checksum of every
tensor in the metadata (:mod:`bridge.checkpoint.checksum`).

Reading: :func:`open_shards` validates the index against the files and the files against each
other; :func:`check_headers` compares names, shapes and dtypes with what is expected, from the
headers alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import struct
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from safetensors import safe_open

from . import checksum, stfile
from .metadata import CheckpointError

__all__ = ["SINGLE", "INDEX", "ST_DTYPES", "FLOAT_DTYPES", "STALE_AFTER_S", "parse_size", "WriteError",
           "write_error", "atomic_directory",
           "remove_stale", "publish", "write_safetensors", "shard_layout", "write_index", "write_shards", "read_json", "read_index", "open_shards",
           "check_headers", "header_bytes"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
             torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
             torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
#: Plain float dtypes transformers casts on load (a plain float tensor may be stored as any of them).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Seconds after which a temporary directory that cannot be traced to a dead process counts as stale.
STALE_AFTER_S = 24 * 3600
_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
_WIDTH = {name: dtype.itemsize for dtype, name in ST_DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """``"2GB"`` -> 2_000_000_000 bytes (ints pass through; KiB/MiB/GiB are powers of two)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive int or a size like '2GB', got {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _new_dir(parent: Path, target: Path, kind: str) -> Path:
    """A fresh ``.NAME.<kind>-HOST-PID-XXXXXXXX`` directory, mode ``0777`` less the umask."""
    for _ in range(100):
        path = parent / f".{target.name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: cannot create a temporary directory for {target.name}")


def _alive(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # Windows: os.kill(pid, 0) would terminate it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


def _stale(path: Path, target: Path, now: float) -> bool:
    m = re.fullmatch(rf"\.{re.escape(target.name)}\.(?:tmp|old)-([A-Za-z0-9._]+)-(\d+)-[0-9a-f]{{8}}", path.name)
    if m is not None and m.group(1) == _HOST and not _alive(int(m.group(2))):
        return True
    try:
        return now - path.lstat().st_mtime > STALE_AFTER_S
    except OSError:
        return False


def remove_stale(target) -> list[Path]:
    """Remove the stale temporary directories of earlier, interrupted saves to ``target``
    (see the module docstring); returns those removed."""
    target = Path(target)
    parent, now, removed = target.parent, time.time(), []
    if not parent.is_dir():
        return removed
    prefixes = (f".{target.name}.tmp-", f".{target.name}.old-")
    for path in sorted(parent.iterdir()):
        if (path.name.startswith(prefixes) and path.is_dir() and not path.is_symlink()
                and _stale(path, target, now)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _make_parents(directory: Path) -> list[Path]:
    """``mkdir -p directory``; returns the directories it created, outermost first."""
    missing = [p for p in (directory, *directory.parents) if not p.exists()][::-1]
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def publish(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` moves aside first, comes back if the rename
    fails, and is deleted last."""
    if not target.exists():
        os.rename(tmp, target)
        return
    trash = _new_dir(target.parent, target, "old")
    os.rename(target, trash / "old")
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(trash / "old", target)
        os.rmdir(trash)
        raise
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(directory, *, overwrite: bool = False):
    """Yield a temporary directory that becomes ``directory`` when the block ends without error
    (see the module docstring)."""
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory; a checkpoint never replaces a file")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target} exists and is not an empty directory; pass overwrite=True to replace it")
    created = _make_parents(target.parent)
    try:
        remove_stale(target)
        tmp = _new_dir(target.parent, target, "tmp")
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield tmp
        publish(tmp, target)
    except OSError as e:  # a full disk, a read-only file system...: said with the target's name
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        if isinstance(e, (FileExistsError, FileNotFoundError)):
            raise
        raise write_error(e, target) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


class WriteError(OSError):
    """An OS error while writing a checkpoint or an export, worded with the target's path:
    ``cannot write /x/out: No space left on device`` (``errno`` as the original's)."""

    def __str__(self) -> str:
        return str(self.strerror)


def write_error(e: BaseException, target) -> WriteError:
    """``e`` (raised while writing ``target``) as a :class:`WriteError` naming ``target`` and what happened;
    a short write (numpy's "N requested and M written") is a full disk. A ``WriteError`` passes through."""
    if isinstance(e, WriteError):
        return e
    errno_ = getattr(e, "errno", None)
    reason = getattr(e, "strerror", None) or str(e).strip() or type(e).__name__
    filename = getattr(e, "filename", None)
    if filename and Path(str(filename)).name not in str(target):
        reason += f" ({Path(str(filename)).name})"
    if errno_ is None and "requested and" in str(e) and "written" in str(e):
        errno_, reason = 28, "No space left on device (a write stopped short)"
    return WriteError(errno_, f"cannot write {target}: {reason}")


def _remove_empty(created: list[Path]) -> None:
    for path in reversed(created):
        try:
            os.rmdir(path)
        except OSError:  # not empty (someone else wrote there meanwhile): left alone
            return


def _nbytes(group: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in group.values())


def _raw(name: str, t: torch.Tensor):
    if t.dtype not in ST_DTYPES:
        raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors checkpoints cannot hold")
    return t.reshape(-1).view(torch.uint8).numpy()


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, str]:
    """Write CPU-contiguous ``tensors`` as one safetensors file with deterministic bytes and the
    checksum of every tensor in its metadata (:mod:`bridge.checkpoint.stfile`); returns ``{name: checksum}``.
    The file is created with ``0666`` less the umask."""
    raw = {n: _raw(n, t) for n, t in tensors.items()}
    entries = {n: (ST_DTYPES[t.dtype], list(t.shape)) for n, t in tensors.items()}
    order = stfile.data_order(entries)
    sums = checksum.digests((n, entries[n][0], entries[n][1], raw[n]) for n in order)
    text = stfile.header(entries, metadata, sums)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for n in order:
            f.write(raw[n].data)
    return sums


def shard_layout(sizes: Sequence[int], max_shard_size="2GB") -> dict[str, list[int]]:
    """The one rule placing groups of tensors in shards, for every writer (:func:`write_shards`, the streamed
    :class:`bridge.stream.shards.ShardPlan`): ``{file name: [group indices]}`` for groups of ``sizes`` bytes in
    order, a group never split, a shard taking groups until the next would pass ``max_shard_size`` (a larger
    group fills one alone); one shard is ``model.safetensors``, more are ``model-0000i-of-0000n.safetensors``."""
    limit = parse_size(max_shard_size)
    shards, cur, size = [], [], 0
    for i, n in enumerate(sizes):
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur or not shards:
        shards.append(cur)
    names = [SINGLE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    return dict(zip(names, shards))


def write_index(directory: Path, weight_map: Mapping[str, str], total: int, index_metadata: Mapping | None) -> None:
    """``model.safetensors.index.json`` of a sharded checkpoint: ``total`` bytes of tensors, where each one is."""
    index = {"metadata": {"total_size": total, **dict(index_metadata or {})}, "weight_map": dict(weight_map)}
    (Path(directory) / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_shards(directory: Path, groups: Iterable[Mapping[str, torch.Tensor]], *, max_shard_size="2GB",
                 file_metadata: Mapping[str, str] | None = None, index_metadata: Mapping | None = None) -> list[str]:
    """Write ``groups`` (dicts of named tensors kept in one shard) as safetensors into ``directory``, placed by
    :func:`shard_layout`; returns the file names. More than one shard gets ``model.safetensors.index.json``."""
    groups = list(groups)
    layout = shard_layout([_nbytes(g) for g in groups], max_shard_size)
    weight_map, total = {}, 0
    for name, members in layout.items():
        tensors = {n: t.detach().to("cpu").contiguous() for i in members for n, t in groups[i].items()}
        write_safetensors(directory / name, tensors, dict(file_metadata or {}))
        weight_map.update({n: name for n in tensors})
        total += _nbytes(tensors)
        del tensors
    if len(layout) > 1:
        write_index(directory, weight_map, total, index_metadata)
    return list(layout)


def read_json(path: Path, what: str):
    """A JSON file, or :class:`CheckpointError` naming it."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing ({what})")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from None


def read_index(root: Path) -> tuple[dict[str, str] | None, list[str]]:
    """``(weight_map or None, shard files)`` of a checkpoint directory (``model.safetensors.index.json`` or a
    single ``model.safetensors``); the file names are checked to be plain names, not their existence."""
    if (root / INDEX).is_file():
        index = read_json(root / INDEX, "shard index")
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{root / INDEX}: needs a 'weight_map' object of tensor name -> file name")
        files = sorted(set(wmap.values()))
    elif (root / SINGLE).is_file():
        wmap, files = None, [SINGLE]
    else:
        raise CheckpointError(f"{root}: no {SINGLE} and no {INDEX}")
    bad = next((f for f in files if "/" in f or "\\" in f or f.startswith(".")), None)
    if bad is not None:
        raise CheckpointError(f"{root / INDEX}: shard name {bad!r} is not a plain file name")
    return wmap, files


def open_shards(root: Path) -> tuple[dict[str, str], dict[str, object]]:
    """``{tensor name: file}`` and open handles, validating the index against the files."""
    wmap, files = read_index(root)
    handles, located = {}, {}
    for f in files:
        path = root / f
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the index is missing")
        try:
            h = safe_open(str(path), framework="pt", device="cpu")
            keys = list(h.keys())
        except Exception as e:  # safetensors raises its own error types for truncated/garbled files
            raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        handles[f] = h
        for k in keys:
            if k in located:
                raise CheckpointError(f"{path}: tensor {k!r} is also stored in {located[k]}")
            located[k] = f
    if wmap is not None:
        for k, f in wmap.items():
            if located.get(k) != f:
                raise CheckpointError(f"{root / INDEX}: tensor {k!r} is mapped to {f}, but "
                                      + (f"it is stored in {located[k]}" if k in located else "no shard holds it"))
    return located, handles


def check_headers(root: Path, located: Mapping[str, str], handles: Mapping, expected: Mapping[str, tuple]) -> None:
    """Exactly the ``expected`` ``{name: (shape, dtype)}`` are stored, from the headers alone."""
    missing = sorted(set(expected) - set(located))
    extra = sorted(set(located) - set(expected))
    if missing:
        raise CheckpointError(f"{root}: missing tensor(s) {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if extra:
        raise CheckpointError(f"{root / located[extra[0]]}: unexpected tensor(s) {extra[:5]} (not in the model "
                              "or its quantization_config)")
    for name, (shape, dtype) in expected.items():
        sl = handles[located[name]].get_slice(name)
        got_shape, got_dtype = tuple(sl.get_shape()), sl.get_dtype()
        want_dtype = ST_DTYPES.get(dtype, str(dtype).removeprefix("torch."))
        if got_shape != tuple(shape) or got_dtype != want_dtype:
            raise CheckpointError(f"{root / located[name]}: tensor {name!r} has shape {list(got_shape)} and dtype "
                                  f"{got_dtype}, expected {list(shape)} and {want_dtype}")


def header_bytes(located: Mapping[str, str], handles: Mapping) -> dict[str, int]:
    """``{stored tensor name: bytes}`` from the shard headers (no tensor data is read)."""
    out = {}
    for name, f in located.items():
        sl = handles[f].get_slice(name)
        n = 1
        for d in sl.get_shape():
            n *= d
        out[name] = n * _WIDTH.get(sl.get_dtype(), 1)
    return out
