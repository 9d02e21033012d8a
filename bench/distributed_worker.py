"""One run of ``bench_distributed.py``: quantize SmolLM2 with a preset through the Python API, in one process or
as one rank of the group torchrun starts (``init_process_group("gloo")`` from torchrun's environment; the
pipeline picks the group up by itself), with the library's functions wrapped in timers (nothing in the library
is changed): each part's exclusive seconds on each rank.

    python bench/distributed_worker.py --preset gptq4-g64 --threads 2 --out DIR --launched T
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/distributed_worker.py --threads 1 ...

Rank 0 writes ``DIR/result.json`` (times of every rank, the quantization's and the process's) and
``DIR/codes.pt`` (every quantized tensor's unpacked codes, scales and zero points), then the perplexity of the
quantized model on the evaluation tokens (with ``--eval-threads`` threads, after the timed part).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist

#: The parts of the time split, in the order they are reported (exclusive seconds: a part's time less the
#: time of the parts inside it).
PARTS = ("capture", "forward", "hessian", "init", "solve", "awq_scales", "awq_clip", "step", "outputs", "comm",
         "wait", "other")


class Timers:
    """Exclusive seconds per part: a wrapped call's time less that of the wrapped calls inside it."""

    def __init__(self):
        self.excl = {p: 0.0 for p in PARTS}
        self.calls = {p: 0 for p in PARTS}
        self.stack: list[list] = []  # [part, start, children seconds]
        self.sets: dict[str, list] = {}  # GPTQ solves by linear kind: [count, seconds (init included), init seconds]

    def wrap(self, part: str, fn, *, barrier: bool = False):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if barrier and not (self.stack and self.stack[-1][0] == "comm"):
                self._barrier()  # the outermost collective: first wait for every rank (the imbalance)
            self.stack.append([part, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                p, t0, inner = self.stack.pop()
                dt = time.perf_counter() - t0
                self.excl[p] += dt - inner
                self.calls[p] += 1
                if self.stack:
                    self.stack[-1][2] += dt
        return timed

    def _barrier(self):
        t0 = time.perf_counter()
        dist.barrier()
        dt = time.perf_counter() - t0
        self.excl["wait"] += dt
        self.calls["wait"] += 1
        if self.stack:
            self.stack[-1][2] += dt


def _by_set(t: Timers, fn):
    """``gptq._solve_set`` recording each solve's seconds (and its init's) by the kind of its linears."""
    @functools.wraps(fn)
    def solve(paths, *args, **kwargs):
        t0, init0 = time.perf_counter(), t.excl["init"]
        try:
            return fn(paths, *args, **kwargs)
        finally:
            kind = "+".join(p.split(".")[-2] for p in paths)
            row = t.sets.setdefault(kind, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += time.perf_counter() - t0
            row[2] += t.excl["init"] - init0
    return solve


def instrument(t: Timers) -> None:
    """Wrap the library's functions where the modules that call them look them up (module globals, class
    attributes); the library's files are not touched."""
    import bridge
    import bridge.calibrate.blocks as blocks
    import bridge.calibrate.calibrator as calibrator
    import bridge.pipeline as pipeline
    import qtransform.algorithms.awq as awq
    import qtransform.algorithms.gptq as gptq
    import qtransform.algorithms.gptq_math as gm
    from bridge.distributed.group import TorchParallel
    from qtransform.observers.hessian import Hessian

    pipeline.quantize_params = t.wrap("other", pipeline.quantize_params)
    bridge.quantize_params = pipeline.quantize_params
    blocks.capture_inputs = t.wrap("capture", blocks.capture_inputs)
    blocks.fold_sites = t.wrap("forward", blocks.fold_sites)  # the block's forward passes with the observers' hooks
    blocks.fit_block_on = t.wrap("outputs", blocks.fit_block_on)  # exclusive: the block run for the next inputs
    for name in ("batch", "merge", "finalize"):
        setattr(Hessian, name, t.wrap("hessian", getattr(Hessian, name)))
    gptq._solve_set = t.wrap("solve", _by_set(t, gptq._solve_set))
    gm._choose = t.wrap("init", gm._choose)  # each group's parameters (init="clip": the clipping search)
    awq.search_scales = t.wrap("awq_scales", awq.search_scales)
    awq._fit_weights = t.wrap("awq_clip", awq._fit_weights)
    for name in ("reduce_stats", "share", "gather", "all_sum", "_merge"):
        setattr(TorchParallel, name, t.wrap("comm", getattr(TorchParallel, name), barrier=name != "_merge"))
    blockwise = calibrator.blockwise

    def timed_blockwise(model, params, plan, batches, fit_block, **kw):
        return blockwise(model, params, plan, batches, t.wrap("step", fit_block), **kw)
    calibrator.blockwise = timed_blockwise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gptq4-g64")
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="calibration sequences per batch")
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-threads", type=int, default=2)
    ap.add_argument("--launched", type=float, default=None, help="time.time() when the process was launched")
    ap.add_argument("--float", action="store_true", help="also the float model's perplexity")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    launched = time.time() if a.launched is None else a.launched
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(a.threads)
    rank = dist.get_rank() if world > 1 else 0

    import qtransform as qt
    import bridge
    from bridge.app import corpus, evaluate, models
    from qtransform.tensor.quantize import unpacked_codes

    timers = Timers()
    instrument(timers)
    model, tok = models.load_with_tokenizer()
    model.eval()
    cal = corpus.token_sequences(corpus.load_text("builtin", part="calibration"), tok, seq_len=a.seq_len,
                                 max_sequences=a.calib)
    recipe = qt.get_preset(a.preset).recipe
    t0 = time.perf_counter()
    with torch.no_grad():
        q = bridge.quantize_params(model, recipe, calibration=list(cal.split(a.batch)))
    quant_s = time.perf_counter() - t0
    if world > 1:
        dist.barrier()
    process_s = time.time() - launched
    mine = {"rank": rank, "quant_s": quant_s, "parts": timers.excl, "calls": timers.calls, "sets": timers.sets,
            "threads": torch.get_num_threads()}
    every = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
        dist.destroy_process_group()
    if rank != 0:
        return
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = {p: {"codes": unpacked_codes(v), "scale": v.qparams.scale, "zero_point": v.qparams.zero_point}
             for p, v in q.qtree.items() if isinstance(v, qt.QTensor)}
    torch.save(saved, out / "codes.pt")
    torch.set_num_threads(a.eval_threads)
    ev = corpus.token_sequences(corpus.load_text("builtin", part="eval"), tok, seq_len=a.seq_len, max_sequences=a.eval)
    t1 = time.perf_counter()
    with torch.no_grad():
        fp = evaluate.perplexity(model, ev).perplexity if a.float else None
        ppl = evaluate.perplexity(bridge.to_module(model, q, kernel="dequant"), ev).perplexity
    result = {"preset": a.preset, "world": world, "quant_s": quant_s, "process_s": process_s, "ranks": every,
              "ppl": ppl, "fp_ppl": fp, "eval_tokens": ev.numel(), "eval_s": time.perf_counter() - t1,
              "calib_tokens": cal.numel(), "batch": a.batch}
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
