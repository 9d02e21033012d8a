"""What ``qtransform train`` keeps while it trains, so that a killed run resumes to the bytes of a run that never
stopped.

The state lives beside the output, in ``<parent>/.<name>.train-state/`` (as a streamed run's ``.partial``
directory does, :mod:`bridge.stream.workdir`): ``state.json`` (the run's fingerprint, the steps done, the loss of
each, the snapshot that holds the tensors) and the snapshot ``step-<N>/``: ``model.safetensors`` (the prepared
model's ``state_dict``: trained float weights, learned ranges; tied tensors stored once), ``optimizer.safetensors``
(the optimizer's per-parameter state and the random generators' states). Safetensors and JSON only, never pickle.

A save writes a new snapshot, then replaces ``state.json`` atomically (written beside, renamed over), then removes
the older snapshots: a run killed at any moment leaves a ``state.json`` naming a whole snapshot. ``--resume``
reopens it when every part of the fingerprint is the same (the model, the recipe, the data, the options that
change what training computes); a part that changed is refused by name.

>>> import tempfile, pathlib
>>> d = TrainState(pathlib.Path(tempfile.mkdtemp()) / "out")
>>> d.path.name, d.exists()
('.out.train-state', False)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import torch

from ..checkpoint import store
from ..stream.workdir import fingerprint, write_json

__all__ = ["TrainState", "Snapshot", "fingerprint", "STATE_FILE"]

STATE_FILE = "state.json"
_VERSION = 1


class Snapshot(NamedTuple):
    """What a run resumes from: ``step`` (steps done), ``losses`` (one per step done), the prepared model's
    ``model`` state (``{key: tensor}``, tied keys filled in), the ``optimizer`` state (``{index: {name: value}}``)
    and ``rng`` (``{"cpu": state, "cuda": state}``)."""

    step: int
    losses: list
    model: dict
    optimizer: dict
    rng: dict


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _write(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    store.write_safetensors(path, {n: _host(t) for n, t in tensors.items()}, {"format": "pt"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _read(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


class TrainState:
    """The training state of the output directory ``target`` (see the module docstring)."""

    def __init__(self, target):
        self.target = Path(target)
        self.path = self.target.parent / f".{self.target.name}.train-state"

    def exists(self) -> bool:
        return (self.path / STATE_FILE).is_file()

    def _record(self) -> dict:
        try:
            record = json.loads((self.path / STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--resume: {self.path / STATE_FILE} cannot be read ({e}); run without --resume to start "
                             "over") from None
        if not isinstance(record, dict) or record.get("version") != _VERSION:
            raise ValueError(f"--resume: {self.path} was written by another version of qtransform train; run without "
                             "--resume to start over")
        return record

    def check(self, fp: Mapping[str, str]) -> None:
        """``ValueError`` naming each part of ``fp`` (a :func:`fingerprint`) that differs from the stored run's (the
        parts ``fp`` holds: the options are checked before the model loads, the data once it is tokenized)."""
        if not self.exists():
            raise ValueError(f"--resume: there is no training state to resume for {self.target} (no {self.path / STATE_FILE}); "
                             "run without --resume")
        old = self._record().get("fingerprint", {})
        changed = [k for k in fp if old.get(k) != fp[k]]
        if changed:
            names = ", ".join(k if k in ("model", "recipe", "data", "versions") else f"--{k}" for k in changed)
            raise ValueError(f"--resume: the interrupted training in {self.path} was made with another {names} than "
                             "this run (changed since); run without --resume to start over")

    def start(self) -> None:
        """A fresh run: any earlier state of this target is removed (the directory is made at the first save)."""
        if self.path.exists():
            shutil.rmtree(self.path)

    def save(self, fp: Mapping[str, str], *, step: int, losses: list, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, rng: Mapping[str, torch.Tensor]) -> None:
        """Record the state after ``step`` steps (see the module docstring for the order that makes it atomic)."""
        self.path.mkdir(parents=True, exist_ok=True)
        snap = f"step-{step:08d}"
        if self.exists() and self._record().get("snapshot") == snap:
            return  # this very state is recorded already (a deterministic run: the same tensors)
        where = self.path / snap
        if where.exists():
            shutil.rmtree(where)
        where.mkdir()
        state, seen, aliases = model.state_dict(), {}, {}
        for key, t in state.items():  # tied tensors (an embedding and its head) stored once
            first = seen.setdefault(_storage_key(t), key)
            if first != key:
                aliases[key] = first
        _write(where / "model.safetensors", {k: t for k, t in state.items() if k not in aliases})
        opt = optimizer.state_dict()["state"]
        tensors, scalars = {}, {}
        for index, entry in opt.items():
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state.{index}.{name}"] = value
                else:
                    scalars[f"{index}.{name}"] = value
        tensors.update({f"rng.{k}": v for k, v in rng.items()})
        _write(where / "optimizer.safetensors", tensors)
        record = {"version": _VERSION, "fingerprint": dict(fp), "step": step, "snapshot": snap, "losses": list(losses),
                  "aliases": aliases, "scalars": scalars}
        write_json(self.path / STATE_FILE, record)
        for old in self.path.iterdir():  # the snapshots state.json no longer names
            if old.is_dir() and old.name.startswith("step-") and old.name != snap:
                shutil.rmtree(old, ignore_errors=True)

    def load(self) -> Snapshot:
        """The snapshot ``state.json`` names (after :meth:`check`)."""
        record = self._record()
        where = self.path / str(record.get("snapshot"))
        try:
            model = _read(where / "model.safetensors")
            rest = _read(where / "optimizer.safetensors")
        except Exception as e:  # noqa: BLE001  (a damaged file: safetensors' or the OS's error, one line)
            raise ValueError(f"--resume: the training state in {where} cannot be read ({type(e).__name__}: {e}); run "
                             "without --resume to start over") from None
        for key, first in record.get("aliases", {}).items():
            model[key] = model[first]
        optimizer: dict[int, dict[str, Any]] = {}
        for name, t in rest.items():
            if name.startswith("state."):
                index, _, field = name[len("state."):].partition(".")
                optimizer.setdefault(int(index), {})[field] = t
        for name, value in record.get("scalars", {}).items():
            index, _, field = name.partition(".")
            optimizer.setdefault(int(index), {})[field] = value
        rng = {name[len("rng."):]: t for name, t in rest.items() if name.startswith("rng.")}
        return Snapshot(int(record["step"]), list(record["losses"]), model, optimizer, rng)

    def remove(self) -> None:
        """Once the output is published: the state is spent."""
        shutil.rmtree(self.path, ignore_errors=True)
