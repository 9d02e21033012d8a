"""Real process groups for the tests: ``run_ranks(world, fn, *args)`` starts ``world`` fresh processes (gloo on
127.0.0.1, a free port; or NCCL), calls ``fn(rank, world, *args)`` in each inside the initialised group, one thread
each, and returns every rank's result (what ``fn`` returns, pickled through a file).

The ranks are forked from a forkserver (one per test process, started at the first call) that has imported torch,
transformers, ``bridge`` and ``qtransform`` once: a spawned rank paid those imports (seconds) every time. The
server is single-threaded and has run no torch kernel (no thread pool to fork), and each rank starts from the
modules' import-time state, as a spawned one did; it gets the caller's environment of the moment."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: imported once by the forkserver, before it forks any rank
PRELOAD = ["torch", "torch.distributed", "transformers", "bridge", "qtransform"]


def _entry(rank, world, port, out, fn, args, backend="gloo", timeout=240.0, environ=None):
    import torch.distributed as dist

    if environ is not None:  # the caller's, not the forkserver's (started by an earlier call)
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if world > 1 or backend != "gloo":
            # a finite timeout: a rank left waiting for a peer fails instead of hanging the suite
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
    # the result is written: leave without the interpreter's finalization, where gloo's worker threads can
    # abort the process (SIGABRT) while releasing what they hold (pytorch/pytorch#179291)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn, *args, timeout: float = 240, backend: str = "gloo") -> list:
    """Every rank's ``fn(rank, world, *args)``; ``RuntimeError`` with a rank's traceback if one failed.
    ``backend="nccl"``: rank ``r`` on ``cuda:r`` (a group even of one process)."""
    mp.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(world, free_port(), out, fn, args, backend, timeout, dict(os.environ)),
                                 nprocs=world, join=False, start_method="forkserver")
        while not ctx.join(timeout=timeout):
            pass
        results = [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world)]
    bad = [f"rank {r}: {v}" for r, (kind, v) in enumerate(results) if kind != "ok"]
    if bad:
        raise RuntimeError("\n".join(bad))
    return [v for _, v in results]
