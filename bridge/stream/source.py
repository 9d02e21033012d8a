"""A float checkpoint read tensor by tensor: its safetensors shards' headers checked first, then each tensor
read from the file when asked for (``pread`` into a fresh tensor: no memory map, so what was read and
dropped leaves nothing resident), never the whole model.

Every problem is found before anything is written: no ``config.json``, no shard, an index naming a file
that is not there or a tensor its file does not hold, a tensor stored twice, a header out of its file's
bounds (a truncated shard), a dtype qtransform does not read. :meth:`Source.map_to` takes the stored tensors as
the tensors of the model built from ``config.json`` through transformers' conversion mapping (renamed tensors,
experts stored one by one and stacked in the model: :mod:`.renames`); from then on ``in``, :meth:`~Source.entry`
and :meth:`~Source.read` take model paths. :meth:`~Source.check_against` compares them with the model (a missing
tensor, a shape that disagrees), naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from ..checkpoint import CheckpointError, checksum, stfile
from ..checkpoint.store import INDEX, ST_DTYPES, read_index
from .renames import Built, Renames, identity

__all__ = ["Source", "Stored", "Built"]

_DTYPES = {name: dtype for dtype, name in ST_DTYPES.items()}


class Stored(NamedTuple):
    """One stored tensor: its file, dtype, shape and the byte range of its data in the file."""

    file: str
    dtype: torch.dtype
    shape: tuple
    begin: int
    end: int


class Source:
    """The tensors of the safetensors checkpoint in ``directory`` (see the module docstring): ``tensors``
    ``{stored name: Stored}``; ``view`` (:class:`~.renames.Renames`) its tensors as the model's."""

    def __init__(self, directory):
        self.root = Path(directory)
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: not a checkpoint directory")
        if not (self.root / "config.json").is_file():
            raise CheckpointError(f"{self.root}: no config.json (a transformers checkpoint directory has one)")
        wmap, files = read_index(self.root)
        self.tensors: dict[str, Stored] = {}
        for f in files:
            self._read_header(f)
        if wmap is not None:
            for name, f in wmap.items():
                got = self.tensors.get(name)
                if got is None or got.file != f:
                    raise CheckpointError(f"{self.root / INDEX}: tensor {name!r} is mapped to {f}, but "
                                          + (f"it is stored in {got.file}" if got else "no shard holds it"))
        self.bytes = sum(s.end - s.begin for s in self.tensors.values())
        self.view = identity(self.tensors)
        self.mapped = None

    def map_to(self, model) -> None:
        """Take the stored tensors as ``model``'s (transformers' conversion mapping of the model; its parameters
        may be on ``meta``): ``in``, :meth:`entry`, :meth:`read` then take the model's paths."""
        if self.mapped is not model:
            self.view, self.mapped = Renames(self.tensors, model), model

    def _read_header(self, f: str) -> None:
        path = self.root / f
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the index is missing")
        header, start = checksum.read_header(path)
        size = path.stat().st_size
        for name, e in header.items():
            if name == "__metadata__":
                continue
            try:
                st, shape, (b, end) = e["dtype"], tuple(int(d) for d in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
            if st not in _DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {st}, which qtransform does not read")
            if end - b != stfile.nbytes(st, shape) or start + end > size or b < 0:
                raise CheckpointError(f"{path}: tensor {name!r} lies outside the file or disagrees with its shape "
                                      f"(the shard is truncated or its header damaged)")
            if name in self.tensors:
                raise CheckpointError(f"{path}: tensor {name!r} is also stored in {self.tensors[name].file}")
            self.tensors[name] = Stored(f, _DTYPES[st], shape, start + b, start + end)

    def config(self) -> dict:
        try:
            return json.loads((self.root / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.root / 'config.json'}: malformed JSON ({e})") from None

    def __contains__(self, path: str) -> bool:
        return path in self.view.entries

    def entry(self, path: str) -> Stored | Built:
        """Where the tensor ``path`` comes from: a stored tensor, or :class:`Built` from several."""
        return self.view.entries[path]

    def nbytes(self, path: str) -> int:
        e = self.entry(path)
        return e.nbytes if isinstance(e, Built) else e.end - e.begin

    def read(self, path: str) -> torch.Tensor:
        """A fresh tensor holding the tensor ``path`` (its stored dtype; a built one from its stored tensors)."""
        if isinstance(self.entry(path), Built):
            return self.view.read(path, self.read_stored)
        return self.read_stored(self.view.names[path])

    def read_stored(self, name: str) -> torch.Tensor:
        """A fresh tensor holding the stored tensor ``name`` (its stored dtype)."""
        s = self.tensors[name]
        out = torch.empty(s.end - s.begin, dtype=torch.uint8)
        view, offset = memoryview(out.numpy()), s.begin
        with open(self.root / s.file, "rb", buffering=0) as fh:
            while len(view):
                n = os.preadv(fh.fileno(), [view], offset)
                if n <= 0:
                    raise CheckpointError(f"{self.root / s.file}: tensor {name!r} ends early (a truncated shard)")
                view, offset = view[n:], offset + n
        return out.view(s.dtype).reshape(s.shape)

    def check_against(self, expected: dict[str, tuple], tied: dict[str, str]) -> None:
        """Every tensor of the model is stored, in its shape: ``expected`` ``{path: shape}`` of its parameters and
        persistent buffers, ``tied`` ``{path: path stored instead}`` for tied weights (one may be absent). Stored
        tensors the model does not load are carried (:mod:`.inventory`), not refused."""
        for path, shape in expected.items():
            name = path if path in self else tied.get(path)
            if name is None or name not in self:
                raise CheckpointError(self._missing(path, shape))
            e = self.entry(name)
            if e.shape != tuple(shape):
                if isinstance(e, Built):
                    raise CheckpointError(self._missing(path, shape, e))
                raise CheckpointError(f"{self.root / e.file}: tensor {self.view.names[name]!r} has shape "
                                      f"{list(e.shape)}, the model of config.json has {list(shape)}")

    def _missing(self, path: str, shape, built: Built | None = None) -> str:
        """The error of a model tensor not (wholly) stored: the stored tensors it is made of (the names
        ``save_pretrained`` gives them) that no shard holds, or those collected for it that are not the model's."""
        names = self.view.saved_names(path, tuple(shape))
        absent = [n for n in names if n not in self.tensors]
        sources, why = (built.sources, None) if built is not None else self.view.broken.get(path, ({}, None))
        got = [n for ns in sources.values() for n in ns]
        what = f"{self.root}: the model of config.json has tensor {path!r} of shape {list(shape)}"
        if built is not None:
            what += f", {len(got)} stored tensors give it shape {list(built.shape)}"
        if names != [path] and absent:
            return f"{what}; it is stored as {len(names)} tensors, of which no shard holds {absent[:5]}"
        extra = [n for n in got if n not in names]
        if names != [path] and extra:
            return f"{what}; the shards also hold {extra[:5]}, which are not tensors of the model of config.json"
        if why is not None:
            return f"{what}; its stored tensors {got[:3] + ['...'] * (len(got) > 3)} do not convert to it ({why})"
        return f"{what}, which no shard holds" if built is None else what
