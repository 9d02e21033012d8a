"""``quantize_checkpoint``: a checkpoint directory in, its quantized checkpoint out, streamed: the model is
never in memory whole.

Steps that need no data and fit one tensor at a time (``rtn``, ``hqq``, any ``local`` step, and recipes
without steps) run shard to shard: each tensor is read from its shard, quantized and written to its place
in the output (:mod:`.shards`), one tensor in memory at a time. Every other recipe runs block by block
(:mod:`.blocks`): the model's skeleton on ``meta``, each decoder block materialised when its turn comes.
Both write the bytes :func:`bridge.save` writes for the same model quantized in memory, with the float
tensors kept in the dtype they are stored in (``dtype="auto"``), and resume after a crash (:mod:`.workdir`).
Inside a ``torch.distributed`` group (``torchrun``) the ranks share the work and rank 0 writes the same bytes
(:mod:`.ranks`).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import torch

import qtransform as qt

from ..checkpoint import metadata
from ..checkpoint.store import FLOAT_DTYPES, parse_size
from ..distributed import current
from ..io import cast_leaf, config_dtype, write_extras
from ..tree import Quantized, Written
from . import skeleton as skel
from .memory import reuse_freed_memory
from .ranks import NoFiles, barrier, drop_scratch, on_rank0, scratch, to_rank0
from .accept import accepted_run
from .shards import ShardFiles, ShardPlan
from .source import Built, Source
from .workdir import WorkDir, calibration_digest, fingerprint

__all__ = ["quantize_checkpoint", "stored_dtypes_of"]


def stored_dtypes_of(source: Source, model, dtype="auto") -> dict[str, torch.dtype]:
    """``{path: dtype}`` the float tensors of ``model`` are stored in: as in ``source`` (``"auto"``; a tied
    path not stored takes its twin's; a tensor built from several stored ones, the dtype they convert to) or
    ``dtype`` for all."""
    source.map_to(model)
    shapes, tied = skel.model_tensors(model, source)
    out = {}
    for path in shapes:
        name = path if path in source else tied.get(path)
        stored = source.entry(name).dtype if name in source else None
        if stored in FLOAT_DTYPES:
            out[path] = stored if dtype == "auto" else dtype
    return out


def _check_dtype(dtype):
    if dtype != "auto" and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be 'auto' or a float torch.dtype {FLOAT_DTYPES}, got {dtype!r}")


def quantize_checkpoint(source, out, recipe, *, calibration: Iterable | None = None, overwrite: bool = False,
                        resume: bool = False, dtype="auto", device="cpu", max_memory=None,
                        max_shard_size="2GB", recipe_name: str | None = None, tokenizer=None, model_class=None,
                        progress: Callable | None = None, act_observer=None, on_tensor: Callable | None = None,
                        before_publish: Callable[[Path, Quantized], None] | None = None,
                        parallel: qt.Parallel | None = None, all_experts: bool = False) -> Quantized:
    """Quantize the checkpoint in directory ``source`` with ``recipe`` into directory ``out``, streamed (see
    the module docstring); the same checkpoint as :func:`bridge.save` of the model quantized in memory.

    Args:
        source: a transformers checkpoint directory (``config.json``, safetensors shards in bf16/fp16/fp32).
        out: the output directory (must not exist or be empty unless ``overwrite``).
        recipe: a :class:`~qtransform.Recipe`, :class:`~qtransform.QuantSpec` or preset's recipe.
        calibration: batches (token-id tensors) for steps that need data; read once per block.
        resume: continue the interrupted run of the same command (see :mod:`bridge.stream.workdir`).
        dtype: ``"auto"`` (float tensors keep their stored dtype) or a float ``torch.dtype`` for all.
        device: where the block being calibrated runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        max_memory: bytes (or ``"4GB"``) of calibration activations kept in memory; beyond, they spill to disk.
        max_shard_size, recipe_name, tokenizer: as for :func:`bridge.save` (without a tokenizer its files
            are copied from ``source``).
        model_class: builds the model from its config (default ``AutoModelForCausalLM``).
        progress: ``progress(iterable, desc=..., total=...)``, e.g. ``tqdm.tqdm``.
        act_observer: the observer of static activation specs (as for :func:`bridge.quantize_params`).
        on_tensor: ``on_tensor(path, float tensor, QTensor)`` for each quantized tensor (the report's rows).
        before_publish: ``before_publish(directory, result)`` adds files (a report) before the checkpoint appears.
        parallel: the ranks running this together (:class:`qtransform.Parallel`; default: the initialised
            ``torch.distributed`` group, else one process). Every rank passes the same arguments (the whole
            calibration: each runs its share); rank 0 alone writes ``out``, calls ``on_tensor``,
            ``progress`` and ``before_publish`` (see :mod:`bridge.stream.ranks`).
        all_experts: calibrate every expert of a mixture-of-experts layer on every token (the routed output
            still feeds the next block; :class:`~bridge.calibrate.ModelCalibrator`).

    Returns:
        The :class:`~bridge.tree.Quantized` result the in-memory run returns, its plan, activation quantizers,
        step reports and rotations, with empty trees and ``written`` (:class:`~bridge.tree.Written`): where
        the tensors went, bytes in and out, seconds, units resumed and the mode.
    """
    t0 = time.perf_counter()
    _check_dtype(dtype)
    if not isinstance(resume, bool):
        raise TypeError(f"resume must be True or False, got {resume!r}")
    dev = torch.device(device)  # a bad device string fails here
    if parallel is not None and not isinstance(parallel, qt.Parallel):
        raise TypeError(f"parallel must be a qtransform.Parallel, got {type(parallel).__name__}")
    par = current(device=dev) if parallel is None else parallel
    budget = None if max_memory is None else parse_size(max_memory)
    prep = accepted_run(source, recipe, calibrated=calibration is not None, model_class=model_class)
    src, model, tied, p, tensor_run = prep.src, prep.model, prep.tied, prep.plan, prep.tensor_run
    dtypes = stored_dtypes_of(src, model, dtype)
    specs = {s: q for s, q in p.activations.items()}
    layout = skel.output_layout(model, p, dtypes, activations=specs)
    file_meta = {"format": "pt", "quant_method": metadata.QUANT_METHOD, "version": str(metadata.VERSION)}
    shard_plan = ShardPlan(layout.groups + prep.inventory.groups(), max_shard_size=max_shard_size, file_metadata=file_meta,
                           index_metadata={"quant_method": metadata.QUANT_METHOD})
    fp = fingerprint(input=_input_fingerprint(src), recipe=p.recipe.to_dict(), dtype=str(dtype),
                     calibration=calibration_digest(calibration), shards=str(max_shard_size),
                     observer=repr(act_observer), device=dev.type,
                     versions=[qt.__version__, torch.__version__], **({"ranks": par.world} if par.world > 1 else {}))
    writer = par.rank == 0  # the others compute the same tensors and write nothing
    if not writer:
        on_tensor = progress = None
    manifest = on_rank0(par, lambda: WorkDir(out, overwrite=overwrite).open(fp, resume=resume))
    work = WorkDir(out, overwrite=True)  # its path (rank 0 checked the target above)
    files = ShardFiles(work.path, shard_plan, sums=None if manifest is None else manifest.get("sums", {})) \
        if writer else NoFiles()
    done = set((manifest or {}).get("done", []))
    try:
        if tensor_run:
            reuse_freed_memory()  # many tensors of the same sizes, one after the other
            run = _TensorRun(src, tied, p, layout, dtypes, files, on_tensor, progress, par)
        else:
            from .blocks import BlockRun

            run = BlockRun(src, tied, model, p, layout, dtypes, files, calibration, device=dev, budget=budget,
                           work=scratch(work.path, par, fresh=manifest is None), progress=progress,
                           on_tensor=on_tensor, act_observer=act_observer, parallel=par, all_experts=all_experts)
        saved = time.monotonic()
        for unit in itertools.chain(run.units(done), _carry(prep.inventory, files, done, writer)):
            done.add(unit)
            if writer and (time.monotonic() - saved > _SAVE_EVERY_S or run.saves_each):
                files.flush()  # what the manifest calls done is on disk
                work.save({"version": 1, "fingerprint": fp, "done": sorted(done), "sums": files.sums})
                saved = time.monotonic()
        acts, online, info = run.results()
        resumed = len((manifest or {}).get("done", []))
        mode = prep.mode

        def finish():
            files.finish()
            qconfig = metadata.checkpoint_config(
                {path: q for path, q in layout.tree.items() if isinstance(q, qt.QTensor)}, recipe=p.recipe,
                recipe_name=recipe_name, rules={path: p[path].rule for path in p.specs}, aliases=layout.aliases,
                activations=acts, online=online, carried=prep.inventory.carried)
            write_extras(model, work.path, qconfig, tokenizer, dtype=config_dtype(dtypes),
                         generation_config=_generation_config(src.root))
            prep.inventory.check(work.path)  # every stored tensor is in the output, or nothing is published
            if tokenizer is None:
                _copy_tokenizer(src.root, work.path)
            size = sum((work.path / f).stat().st_size for f in shard_plan.files)
            result = _result(p, info, acts, online, Written(str(out), src.bytes, size, time.perf_counter() - t0,
                                                           resumed, mode, prep.inventory.carried))
            if before_publish is not None:
                before_publish(work.path, result)
            work.publish()
            return size

        barrier(par)  # every rank is done with its scratch
        size = on_rank0(par, finish)
        drop_scratch(work.path, par)
    finally:
        files.close()
    return _result(p, info, acts, online, Written(str(out), src.bytes, size, time.perf_counter() - t0, resumed, mode, prep.inventory.carried))


def _carry(inventory, files, done, writer: bool):
    """The stored tensors the model does not load, written as they are stored (one unit: ``"carried"``)."""
    if inventory.carried and "carried" not in done:
        if writer:
            for name in inventory.carried:
                files.put({name: inventory.read(name)})
        yield "carried"


def _result(p: qt.Plan, info, acts, online, written: Written) -> Quantized:
    """The run's :class:`~bridge.tree.Quantized` result: its facts, and where its tensors went."""
    return Quantized({}, {}, p, dict(acts), dict(info), dict(online), written=written)


def _input_fingerprint(src: Source) -> dict:
    return {"config": (src.root / "config.json").read_text(),
            "tensors": {n: [s.file, str(s.dtype), list(s.shape), s.begin, s.end] for n, s in src.tensors.items()},
            "sizes": {f: (src.root / f).stat().st_size for f in sorted({s.file for s in src.tensors.values()})}}


def _generation_config(root: Path):
    """The generation config ``from_pretrained`` gives a model of ``root`` (its file, else made from config.json)."""
    from transformers import GenerationConfig

    if (root / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(root), local_files_only=True)
    return GenerationConfig.from_pretrained(str(root), config_file_name="config.json", _from_model_config=True,
                                            local_files_only=True)


def _copy_tokenizer(root: Path, to: Path) -> None:
    import shutil

    from ..checkpoint.tree_io import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        if (root / name).is_file():
            shutil.copy2(root / name, to / name)


#: seconds between two records of the tensors done (shard to shard: each tensor takes a fraction of a second)
_SAVE_EVERY_S = 2.0


class _TensorRun:
    """Shard to shard: each tensor read, quantized with the recipe's local steps and written (one unit each).

    On several ranks the quantized tensors are split among them: in windows of ``WINDOW`` per rank (in the
    checkpoint's order), each owned by a rank chosen by cost (its stored size, largest first to the least
    loaded rank), read and quantized there and gathered to rank 0, which writes them and, alone, the tensors
    stored unchanged. Each tensor is quantized alone, so where it runs changes no byte."""

    saves_each = False
    #: quantized tensors per rank in one window (what rank 0 holds quantized before writing them)
    WINDOW = 4

    def __init__(self, src, tied, p, layout, dtypes, files, on_tensor, progress, parallel=qt.SERIAL):
        self.src, self.p, self.layout, self.dtypes, self.files = src, p, layout, dtypes, files
        self.on_tensor, self.progress, self.par = on_tensor, progress, parallel
        self._tied = {path: path if path in src else tied[path] for path in layout.tree if path not in layout.aliases}

    def units(self, done):
        paths = [p for p in self.layout.tree if p not in self.layout.aliases and p not in done]
        if self.par.world > 1:
            yield from self._split(paths)
            return
        todo = self.progress(paths, desc="tensors", total=len(paths)) if self.progress else paths
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="qtransform-reader") as reader:
            ahead = None
            for i, path in enumerate(todo):
                got = ahead.result() if ahead is not None else self._read(path)
                nxt = paths[i + 1] if i + 1 < len(paths) else None
                ahead = reader.submit(self._read, nxt) if nxt is not None else None  # the next read overlaps
                self._one(path, got)
                yield path

    def _split(self, paths):
        """The units on several ranks (see the class docstring); every rank yields every unit."""
        par, writer = self.par, self.par.rank == 0
        quantized = [q for q in paths if q in self.p.specs]
        if writer:
            for path in paths:
                if path not in self.p.specs:
                    self._one(path, self._read(path))
                    yield path
        size = self.WINDOW * par.world
        windows = [quantized[i:i + size] for i in range(0, len(quantized), size)]
        todo = self.progress(windows, desc=f"tensors ({size} at a time)", total=len(windows)) \
            if self.progress else windows
        for window in todo:
            owners = par.owners({q: float(self.src.nbytes(self._tied[q])) for q in window})
            mine = {q: self._quantize(q, self._read(q).float()) for q in window if owners[q] == par.rank}
            parts = to_rank0(par, mine)
            if writer:
                got = {q: v for part in parts for q, v in part.items()}
                for q in window:
                    if self.on_tensor is not None:
                        self.on_tensor(q, self._read(q).float(), got[q])  # read again: only the codes travelled
                    self.files.put(skel.stored_parts(q, got[q]))
            yield from window

    def _quantize(self, path: str, w: torch.Tensor):
        q = qt.quantize_tree({path: w}, self.p.restrict([path]))[path]
        return cast_leaf(q, self.dtypes.get(path, q.dtype))
    def _read(self, path: str):
        """The quantized tensors' values (read ahead); ``None`` for a tensor copied as stored."""
        name = self._tied[path]
        e = self.src.entry(name)
        if path in self.p.specs or isinstance(e, Built) or self.dtypes.get(path, e.dtype) != e.dtype:
            return self.src.read(name)
        return None

    def _one(self, path: str, t) -> None:
        if t is None:  # stored unchanged: copied from the input's bytes
            s = self.src.entry(self._tied[path])
            self.files.put_raw(path, self.src.root / s.file, s.begin, s.end, s.dtype, s.shape)
        elif path in self.p.specs:
            w = t.float()
            q = self._quantize(path, w)
            if self.on_tensor is not None:
                self.on_tensor(path, w, q)
            self.files.put(skel.stored_parts(path, q))
        else:
            self.files.put({path: cast_leaf(t, self.dtypes[path]) if path in self.dtypes else t})

    def results(self):
        return {s: q for s, q in self.p.activations.items()}, {}, {}
