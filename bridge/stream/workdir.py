"""Where a streamed quantization writes while it runs, and what lets it resume after a crash.

The checkpoint is written in ``<parent>/.<name>.partial`` beside its target and renamed to the target
only when complete (nothing half-written ever appears under the target's name). That directory holds
``manifest.json``: the run's :func:`fingerprint` (the input checkpoint's files, the recipe, the
calibration data, the options that change bytes, the versions) and what is done (the units finished,
the checksums of the tensors written, the calibration cache of the next block). A run killed at any
point leaves it behind; the same command with ``resume=True`` (``--resume``) continues after the last
unit recorded and writes the same bytes as a run that never stopped. A fingerprint that differs is
refused, naming what changed; a run without ``resume`` starts over (the old directory is removed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from ..checkpoint import store

__all__ = ["fingerprint", "calibration_digest", "WorkDir", "MANIFEST", "write_json"]

MANIFEST = "manifest.json"
_VERSION = 1


def _digest(value: Any) -> str:
    h = hashlib.sha256()
    if isinstance(value, (bytes, bytearray)):
        h.update(value)
    else:
        h.update(json.dumps(value, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def fingerprint(**parts: Any) -> dict[str, str]:
    """``{part: short digest}`` of each named part of a run (JSON-able values or bytes)."""
    return {k: _digest(v) for k, v in sorted(parts.items())}


def calibration_digest(batches) -> str | None:
    """A digest of the calibration batches (token-id tensors or dicts of them), ``None`` without data."""
    if batches is None:
        return None
    import torch

    h = hashlib.sha256()

    def add(x):
        if isinstance(x, torch.Tensor):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, Mapping):
            for k in sorted(x):
                h.update(str(k).encode())
                add(x[k])
        else:
            h.update(repr(x).encode())

    for batch in batches:
        add(batch)
    return h.hexdigest()[:16]


class WorkDir:
    """The ``.partial`` directory of ``target`` (see the module docstring)."""

    def __init__(self, target, *, overwrite: bool = False):
        self.target = Path(target)
        if self.target.exists() and not self.target.is_dir():
            raise FileExistsError(f"{self.target} exists and is not a directory; a checkpoint never replaces a file")
        if self.target.exists() and any(self.target.iterdir()) and not overwrite:
            raise FileExistsError(f"{self.target} exists and is not an empty directory; pass overwrite=True to "
                                  "replace it")
        self.path = self.target.parent / f".{self.target.name}.partial"

    def open(self, fp: Mapping[str, str], *, resume: bool) -> dict | None:
        """Create the directory, or with ``resume`` reopen the one left by an interrupted run of the same
        fingerprint ``fp`` and return its manifest (``None``: starting over)."""
        if resume and (self.path / MANIFEST).is_file():
            try:
                manifest = json.loads((self.path / MANIFEST).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"--resume: {self.path / MANIFEST} cannot be read ({e}); run without --resume to "
                                 "start over") from None
            old = manifest.get("fingerprint", {}) if isinstance(manifest, dict) else {}
            changed = sorted(k for k in set(old) | set(fp) if old.get(k) != fp.get(k))
            if manifest.get("version") != _VERSION or changed:
                raise ValueError(f"--resume: the interrupted run in {self.path} was made with other "
                                 f"{', '.join(changed) or 'versions'} than this one (they changed since); run "
                                 "without --resume to start over")
            return manifest
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        store.remove_stale(self.target)  # what dead in-memory saves to the same place left, as atomic_directory does
        os.mkdir(self.path, 0o777)
        self.save({"version": _VERSION, "fingerprint": dict(fp), "done": []})
        return None

    def save(self, manifest: Mapping) -> None:
        """Record ``manifest`` atomically (written beside, then renamed over the old one)."""
        write_json(self.path / MANIFEST, manifest)

    def publish(self) -> None:
        """The finished checkpoint under the target's name (the manifest and caches removed first)."""
        for leftover in (MANIFEST, "cache"):
            p = self.path / leftover
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        store.publish(self.path, self.target)


def write_json(path: Path, record: Mapping) -> None:
    """``record`` as JSON at ``path``, atomically: written beside, synced, then renamed over the old file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
