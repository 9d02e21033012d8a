"""Block by block: the recipe's steps on one decoder block at a time, materialised from the shards when its
turn comes, with the calibration activations carried from block to block (:mod:`.cache`).

The in-memory pipeline makes one pass over the model per block-by-block step (GPTQ, AWQ, SmoothQuant) and one
for the static activation quantizers (their statistics on the model with its weights quantized). A streamed
run makes one pass over the blocks and keeps one *stream* of activations per such pass: for each block, the
recipe's steps run on the block alone (``qt.quantize_tree`` with the plan restricted to it), calling a
calibrator told which pass each call serves (the step's index: :func:`qtransform.pipeline.run.serving`), which
serves the block's inputs from the stream of that pass and carries its outputs to the next
block, exactly as that pass would have. So every block sees what it would have seen in memory, and the
checkpoint has the same bytes. The tensors outside the blocks (embeddings, final norm, head) are read,
quantized (by the recipe's steps that fit one tensor without data, else round to nearest: block-by-block
steps never fit them) and written one at a time.

After each block (or every ``SNAPSHOT_EVERY_S`` seconds when the activations are large) the streams are
saved in the run's scratch directory, so that a resumed run starts from there.

On several ranks (``parallel``) each stream holds this rank's contiguous share of its batches, the block's
statistics reduce over the ranks (``fit_block_on(..., parallel=)``, ``site_stats``), every rank holds the
same quantized block, and each saves its own share in its own scratch directory (see :mod:`.ranks`).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import qtransform as qt

from ..arch.towers import towers
from ..calibrate.own_inputs import strip_hidden
from ..calibrate.blocks import (capture_blocks, chosen, find_blocks, fit_block_on, hidden_of, hidden_slot,
                               with_hidden)
from ..calibrate.sites import first_tensor, fold_sites, to_device
from ..io import cast_leaf
from ..pipeline import calibrate_activations
from ..modules.actquant import stored_buffers
from ..modules.online import installed
from .cache import ActivationCache
from .ranks import barrier
from .skeleton import stored_parts

__all__ = ["BlockRun", "SNAPSHOT_EVERY_S", "SNAPSHOT_BYTES"]

#: streams up to this many bytes are saved after every block; larger ones every SNAPSHOT_EVERY_S seconds
SNAPSHOT_BYTES = 512 * 2**20
SNAPSHOT_EVERY_S = 600.0


class _Calibrator:
    """The calibrator of one block: each call is told the pass it serves (``step``: the recipe step's index, or
    ``"activations"``, :func:`qtransform.pipeline.run.serving`) and is served by that pass's stream."""

    def __init__(self, run: "BlockRun", name: str):
        self.run, self.name = run, name

    def blockwise(self, params, plan, fit_block, *, step, qparams=None, tokens=None, online=None, float_inputs=False):
        inputs = self.run.inputs(step, tokens)
        floats = self.run.inputs(f"{step}f", tokens) if float_inputs else None  # the float chain: its own stream
        with installed(self.run.model, online):
            fit, nxt, floats = fit_block_on(self.run.model, self.name, params, inputs, plan, fit_block,
                                            dict(qparams or {}), parallel=self.run.parallel,
                                            all_experts=self.run.all_experts, float_inputs=floats)
        self.run.carry(step, nxt)
        if floats is not None:
            self.run.carry(f"{step}f", floats)
        return fit

    def site_stats(self, params, sites, *, step, online=None):
        inputs = self.run.inputs(step, None, quantized_prefix=True)
        module = self.run.model.get_submodule(self.name)
        local = {p[len(self.name) + 1:]: t for p, t in params.items() if p.startswith(self.name + ".")}
        outs = []

        def run_all():
            with torch.no_grad():
                outs.extend(torch.func.functional_call(module, local, a, kw) for a, kw in inputs)
            return len(inputs)

        with installed(self.run.model, online):
            stats = fold_sites(self.run.model, sites, run_all, where=f"block {self.name}", parallel=self.run.parallel,
                               all_experts=self.run.all_experts)

        self.run.carry(step, [with_hidden(a, kw, first_tensor(o), hidden_slot(a, kw), self.name)
                          for (a, kw), o in zip(inputs, outs)])
        return stats


class BlockRun:
    """The block-by-block run of :func:`bridge.stream.quantize_checkpoint` (see the module docstring); ``work``
    is this rank's scratch directory (spilled activations, snapshots)."""

    saves_each = True

    def __init__(self, src, tied, model, p, layout, dtypes, files, calibration, *, device, budget, work,
                 progress=None, on_tensor=None, act_observer=None, parallel: qt.Parallel = qt.SERIAL,
                 all_experts: bool = False):
        self.src, self.model, self.p, self.layout, self.dtypes, self.files = src, model, p, layout, dtypes, files
        self.calibration, self.device, self.work, self.progress = calibration, device, Path(work), progress
        self.on_tensor, self.act_observer, self.parallel = on_tensor, act_observer, parallel
        self.all_experts = all_experts
        self.names = find_blocks(model)
        self.current = self.names[0]
        paths = list(model.state_dict(keep_vars=True))
        self.stored = {path: path if path in src else tied[path] for path in paths}
        self.inside = {n: [q for q in paths if q.startswith(n + ".")] for n in self.names}
        within = {q for ps in self.inside.values() for q in ps}
        first = min(paths.index(ps[0]) for ps in self.inside.values() if ps)
        self.outside = [q for q in paths if q not in within]
        parts = towers(model)  # a multimodal model's towers run before its blocks on image batches
        self.prefix = [q for q in self.outside if paths.index(q) < first or any(q.startswith(t + ".") for t in parts)]
        self.cache = ActivationCache(self.work / "spill", budget)
        self.own, self.streams = [], {}  # each block's own inputs, batch by batch (hidden states: the streams')
        self.acts, self.info, self.online = {}, {}, {}
        self._initial = self._initial_q = self._prefix = None
        self._prefix_written = False
        self._snapped = time.monotonic()

    # -- streams -------------------------------------------------------------------------------------------
    def _read(self, path: str) -> torch.Tensor:
        return self.src.read(self.stored[path]).to(self.device, torch.float32 if self.src.entry(
            self.stored[path]).dtype.is_floating_point else None)

    def _capture(self, quantized: bool) -> list:
        """Every block's own inputs (:func:`~bridge.calibrate.blocks.capture_blocks`: the blocks are not loaded,
        so pass-throughs stand in for them or the model is refused by name), the prefix (embeddings) run with the
        recipe's steps without data applied (``quantized``: and its quantized tensors dequantized, as the static
        activations' pass sees them)."""
        if self._prefix is None:  # read, transformed, quantized and written once
            params = {q: self._read(q) for q in self.prefix}
            qtree, fit = self._outside(self.prefix, params)
            self._prefix = ({**params, **fit.params}, qtree)
            self._prefix_written = True
        changed, qtree = self._prefix
        params = {q: qt.dequantize(qtree[q]) if quantized and isinstance(qtree[q], qt.QTensor) else changed[q]
                  for q in self.prefix}
        params.update({q: self._read(q) for q in self.inside[self.names[0]]})  # the first block runs: its output's form
        with torch.no_grad():
            return capture_blocks(self.model, params, self.names, self.calibration, real=False)

    def inputs(self, k: int | str, tokens, *, quantized_prefix: bool = False) -> list:
        """The inputs of the current block for stream ``k`` (``"<k>f"``: the float chain of pass ``k``; made from the prefix's outputs at the first block:
        every pass starts there; ``tokens``: whole batches spread over the data, as the step asks)."""
        if k not in self.streams:
            if self._initial is None:  # both captures at once: the embeddings are freed before the block's work
                self._initial = self._capture(False)
                static = any(not spec.dynamic for spec in self.p.activations.values())
                if static and any(q in self.p.specs for q in self.prefix):
                    self._initial_q = self._capture(True)
                self._prefix = None
                if any(rec[0][0] is None for rec in self._initial):
                    raise ValueError(f"block-by-block calibration: the first block ({self.names[0]}) takes no tensor input")
                self.own = [[strip_hidden(a, kw, slot) for slot, a, kw in rec]
                            for rec in self._initial]  # the hidden states go to the streams
            records = self._initial_q if quantized_prefix and self._initial_q is not None else self._initial
            self.streams[k] = chosen([(a, kw) for (_, a, kw), *_ in records], tokens, self.parallel)
            for j in self.streams[k]:
                self.cache.put(f"s{k}-b{j}", hidden_of(*records[j][0][1:]))
        i = self.names.index(self.current)
        out = []
        for j in self.streams[k]:
            slot, args, kwargs = self.own[j][i]
            out.append(to_device(with_hidden(args, kwargs, self.cache.get(f"s{k}-b{j}"), slot, self.current), self.device))
        return out

    def carry(self, k: int | str, nxt: list) -> None:
        for j, (a, kw) in zip(self.streams[k], nxt):
            self.cache.put(f"s{k}-b{j}", hidden_of(a, kw))

    # -- the run -------------------------------------------------------------------------------------------
    def units(self, done):
        start = self._restore(done)
        order = range(start, len(self.names))
        todo = self.progress(order, desc="blocks", total=len(self.names) - start) if self.progress else order
        for i in todo:
            self._block(self.names[i])
            self._initial = self._initial_q = self._prefix = None  # the first block made every stream
            if self._snapshot(i, force=i == len(self.names) - 1):
                barrier(self.parallel)  # every rank saved its share before rank 0 records the block done
                yield f"block {i}"
                barrier(self.parallel)  # ... and no rank drops an older snapshot before that record
                self._drop_snapshots(but=i)
        rest = [q for q in self.outside if q not in self.prefix]
        for paths in ([] if self._prefix_written else [self.prefix]) + [rest]:  # the prefix, unless the capture wrote it
            if paths:
                self._outside(paths, {q: self._read(q) for q in paths}, write=True)
        yield "outside"

    def _plain(self, path: str, t: torch.Tensor) -> torch.Tensor:
        t = t.to("cpu")
        return cast_leaf(t, self.dtypes[path]) if path in self.dtypes else t.to(self.src.entry(self.stored[path]).dtype)

    def _put_quantized(self, path: str, w: torch.Tensor, q) -> None:
        q = cast_leaf(q, self.dtypes.get(path, q.dtype))
        if self.on_tensor is not None:
            self.on_tensor(path, w, q)
        self.files.put({n: t.to("cpu") for n, t in stored_parts(path, q).items()})

    def _outside(self, paths: list, params: dict, *, write: bool = True):
        """Tensors outside the blocks (the embeddings, the final norm and head), as the in-memory run treats
        them: the recipe's steps without data (the local ones, rotations), then round to nearest from what
        they fitted (block-by-block steps never fit them); written with ``write``. Returns ``(qtree, fit)``."""
        steps = tuple(s for s in self.p.steps if qt.get_algorithm(s.name).needs is None)
        qtree, fit = qt.quantize_tree(params, self._plan(paths, steps), with_info=True)
        if write:
            self._write(paths, params, qtree)
        self.info.update(fit.info)
        self.online.update(fit.online)
        return qtree, fit

    def _plan(self, paths, steps=None) -> qt.Plan:
        """The plan restricted to ``paths`` (a block or a part outside them): its attention modules, its part
        of the residual layout; ``steps`` instead of the recipe's when given."""
        inside = set(paths)
        p = self.p.restrict(paths)
        changes = {"attention": [a for a in self.p.attention if any(q.startswith(a + ".") for q in paths)]}
        if self.p.layout is not None:
            changes["layout"] = self.p.layout.restrict(inside)
        if steps is not None and tuple(steps) != tuple(p.steps):
            changes["recipe"] = dataclasses.replace(p.recipe, steps=tuple(steps))
        return p.replace(**changes)

    def _write(self, paths, params: dict, qtree: dict) -> None:
        for q in paths:
            v = qtree[q]
            if q in self.layout.aliases:
                continue
            if isinstance(v, qt.QTensor):
                self._put_quantized(q, params[q], v)
            else:
                self.files.put({q: self._plain(q, v)})

    def _block(self, name: str) -> None:
        self.current = name
        paths = self.inside[name]
        params = {q: self._read(q) for q in paths}
        p = self._plan(paths)
        cal = _Calibrator(self, name)
        qtree, fit = qt.quantize_tree(params, p, calibrator=cal, with_info=True)
        acts = calibrate_activations(qtree, p, cal, act_observer=self.act_observer, online=fit.online)
        self._write(paths, params, qtree)
        for site, qp in acts.items():
            if isinstance(qp, qt.QParams):
                module = self.model.get_submodule(site.module)
                self.files.put({f"{site.module}.{n}": t.to("cpu") for n, t in stored_buffers(module, site.role, qp).items()})
        self.acts.update(acts)
        self.info.update(fit.info)
        self.online.update(fit.online)

    def results(self):
        acts = {s: self.acts.get(s, spec) for s, spec in self.p.activations.items()}
        return acts, self.online, self.info

    # -- snapshots (resume) --------------------------------------------------------------------------------
    def _snapdir(self, i: int) -> Path:
        return self.work / f"after-block-{i}"

    def _snapshot(self, i: int, force: bool = False) -> bool:
        """Save this rank's streams after block ``i`` (every rank decides alike: by the largest rank's streams
        and rank 0's clock); whether it did."""
        held = self.parallel.gather((self.cache.total, time.monotonic() - self._snapped))
        if not force and max(t for t, _ in held) > SNAPSHOT_BYTES and held[0][1] < SNAPSHOT_EVERY_S:
            return False
        tmp = self.work / f"tmp-{i}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for k, js in self.streams.items():
            save_file({str(j): self.cache.get(f"s{k}-b{j}").contiguous() for j in js}, str(tmp / f"stream-{k}.safetensors"))
        acts = {f"{s.module}|{s.role}": q.tensors() for s, q in self.acts.items() if isinstance(q, qt.QParams)}
        torch.save({"streams": self.streams, "own": self.own, "acts": acts, "info": self.info}, tmp / "state.pt")
        shutil.rmtree(self._snapdir(i), ignore_errors=True)  # one a run killed before recording it left
        tmp.rename(self._snapdir(i))
        self._snapped = time.monotonic()
        return True

    def _drop_snapshots(self, but: int) -> None:
        """Remove the snapshots before block ``but``'s (once the manifest records it: the one it names stays)."""
        for old in self.work.glob("after-block-*"):
            if old != self._snapdir(but):
                shutil.rmtree(old, ignore_errors=True)

    def _restore(self, done) -> int:
        blocks = [int(u.split()[1]) for u in done if u.startswith("block ")]
        if not blocks:
            return 0
        i = max(blocks)
        d = self._snapdir(i)
        state = torch.load(d / "state.pt", weights_only=False)
        self.streams, self.own, self.info = state["streams"], state["own"], state["info"]
        specs = self.p.activations
        for key, tensors in state["acts"].items():
            module, role = key.split("|")
            site = qt.Site(module, role)
            self.acts[site] = qt.QParams(spec=specs[site], **tensors)
        for k, js in self.streams.items():
            got = load_file(str(d / f"stream-{k}.safetensors"))
            for j in js:
                self.cache.put(f"s{k}-b{j}", got[str(j)])
        return i + 1
