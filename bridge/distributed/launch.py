"""Running the command under ``torchrun``: the process group from torchrun's environment, who speaks, who
writes, and how an error on one rank stops all of them.

``torchrun`` (or ``python -m torch.distributed.run``) starts one process per rank with ``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment. :func:`init` reads them
and initialises the default process group (gloo on the CPU; NCCL for CUDA, each rank on
``cuda:LOCAL_RANK``) with a finite timeout; the pipeline then finds it by itself
(:func:`bridge.distributed.current`). Rank 0 (:func:`is_main`) alone writes files and speaks; the other
ranks are :func:`quiet`. :func:`stage` makes the ranks agree at fixed points: a rank failing inside a stage
tells the others, and every rank stops with that rank's message (no collective is left waiting). An error
outside a stage (in the middle of the collectives) ends the failing rank at once: torchrun's agent stops
the other workers of its node, and a rank waiting on the dead one gets a connection error (gloo) or the
timeout (:data:`DEFAULT_TIMEOUT`). :func:`relaunch` is ``qtransform quantize --nproc N``: the same command
under torchrun.

Outside torchrun (no ``WORLD_SIZE``, or a world of one) nothing is initialised and every function is the
one-process answer:

>>> env = from_env({})
>>> env.world, env.rank, env.local_rank, env.launched
(1, 0, 0, False)
>>> from_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0"})
Env(world=2, rank=1, local_rank=0, launched=True)
>>> from_env({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"})
Traceback (most recent call last):
...
ValueError: environment variable RANK=2: must be in [0, WORLD_SIZE=2)
>>> strip_option(["quantize", "--nproc", "2", "--calib=4", "--nproc=3", "--npr", "4"], "--nproc")
['quantize', '--calib=4']
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

__all__ = ["Env", "RankFailed", "DEFAULT_TIMEOUT", "from_env", "init", "teardown", "is_main", "rank", "world",
           "where", "quiet", "stage", "threads_per_rank", "strip_option", "relaunch"]

#: Seconds a collective may wait for the other ranks before failing (``--dist-timeout``): a rank that died or
#: hangs stops the others after at most this long, even where no connection error tells them (NCCL).
DEFAULT_TIMEOUT = 1800

_owned = False  # whether init() created the default group (teardown destroys only that one)


class Env(NamedTuple):
    """What torchrun's environment says: ``world`` processes, this one ``rank`` (``local_rank`` on its
    machine); ``launched``: ``WORLD_SIZE`` is set (torchrun or an equivalent launcher started this process)."""

    world: int
    rank: int
    local_rank: int
    launched: bool


class RankFailed(RuntimeError):
    """Another rank failed inside a :func:`stage`: this one stops with that rank's message."""


def _int(environ: Mapping[str, str], name: str, default: int | None) -> int:
    text = environ.get(name)
    if text is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set (WORLD_SIZE is: launch with torchrun)")
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r}: not an integer") from None


def from_env(environ: Mapping[str, str] | None = None) -> Env:
    """The launch described by ``environ`` (default ``os.environ``); ``ValueError`` naming the variable when
    it is inconsistent."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" not in environ:
        return Env(1, 0, 0, False)
    size = _int(environ, "WORLD_SIZE", None)
    if size < 1:
        raise ValueError(f"environment variable WORLD_SIZE={size}: must be at least 1")
    r = _int(environ, "RANK", None if size > 1 else 0)
    if not 0 <= r < size:
        raise ValueError(f"environment variable RANK={r}: must be in [0, WORLD_SIZE={size})")
    local = _int(environ, "LOCAL_RANK", 0)
    if local < 0:
        raise ValueError(f"environment variable LOCAL_RANK={local}: must be at least 0")
    return Env(size, r, local, True)


def world() -> int:
    """Processes in the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0, or the only process: the one that writes files and speaks."""
    return rank() == 0


def where() -> str:
    """``"rank R: "`` in a group of several processes (the prefix of this rank's error message), else ``""``."""
    return f"rank {rank()}: " if world() > 1 else ""


def init(device: str | torch.device | None = None, *, timeout: float = DEFAULT_TIMEOUT,
         environ: Mapping[str, str] | None = None) -> Env:
    """The default process group of torchrun's environment, initialised (unless a group already is, or the
    world is one process: then nothing is done). ``device``: where the run computes; CUDA selects NCCL and
    this rank's ``cuda:LOCAL_RANK`` (an explicit other index is refused when several ranks share a machine),
    anything else gloo. ``timeout`` (seconds, finite) bounds every collective's wait."""
    global _owned
    env = from_env(environ)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if env.world == 1 or (dist.is_available() and dist.is_initialized()):
        return env
    if not dist.is_available():
        raise ValueError(f"WORLD_SIZE={env.world} but this torch has no torch.distributed")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    kwargs = {}
    if dev.type == "cuda":
        if env.local_rank >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: rank {env.rank} is local rank {env.local_rank} of its machine, which "
                             f"has {torch.cuda.device_count()} CUDA device(s): one rank per GPU (--nproc-per-node at "
                             f"most the GPUs)")
        if dev.index is not None and dev.index != env.local_rank:
            raise ValueError(f"--device {device}: under torchrun each rank computes on cuda:LOCAL_RANK (here "
                             f"cuda:{env.local_rank}); pass --device cuda")
        torch.cuda.set_device(env.local_rank)
        backend = "nccl"
        kwargs["device_id"] = torch.device("cuda", env.local_rank)
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **kwargs)
    _owned = True
    return env


def teardown(*, failed: bool = False) -> None:
    """Destroy the default group if :func:`init` created it (a group the caller initialised stays). Call it
    after a failure too (``failed=True``): a gloo group left to the interpreter's exit can abort the process;
    a NCCL group is then left as it is (destroying it could wait on a peer that hangs: the process's exit
    closes it)."""
    global _owned
    if _owned and dist.is_initialized() and not (failed and dist.get_backend() == "nccl"):
        dist.destroy_process_group()
    _owned = False


def quiet() -> None:
    """Silence this process's output but its errors (ranks other than 0): stdout goes to the null device,
    tqdm bars are off, transformers' and the Hub's progress bars too. Errors still go to stderr."""
    sys.stdout.flush()
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (for the life of the process)
    os.environ["TQDM_DISABLE"] = "1"
    try:
        from functools import partialmethod

        from tqdm import tqdm
        tqdm.__init__ = partialmethod(tqdm.__init__, disable=True)
    except ImportError:  # pragma: no cover
        pass
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as tf_logging
        tf_logging.disable_progress_bar()
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()


def _message(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextlib.contextmanager
def stage():
    """A stretch of work after which the ranks agree (one ``all_gather_object``; nothing in one process): an
    exception inside it on any rank is sent to all, which then raise :class:`RankFailed` naming the first
    failing rank and its message (the failing rank re-raises its own). Use it around work without
    collectives, that may fail on one rank only (a path missing on one machine, a check)."""
    if world() == 1:
        yield
        return
    try:
        yield
    except BaseException as e:
        plain = isinstance(e, (OSError, ValueError)) or type(e).__name__ == "UserError"  # the command's own words
        _exchange(_message(e) if plain else f"{type(e).__name__}: {_message(e)}")
        raise
    failed = _exchange(None)
    if failed:
        r, msg = failed[0]
        raise RankFailed(f"stopped: rank {r} failed: {msg}")


def _exchange(error: str | None) -> list[tuple[int, str]]:
    every = [None] * world()
    dist.all_gather_object(every, error)
    return [(r, m) for r, m in enumerate(every) if m is not None]


def threads_per_rank(local_world: int, *, cores: int | None = None) -> int:
    """CPU threads for each of ``local_world`` ranks on one machine: its cores shared evenly, at least 1."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world))


def strip_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value: ``--opt V``, ``--opt=V``, and argparse's abbreviations of
    ``option`` (``--op V``: a prefix of it, of at least two letters after the dashes)."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if tok.startswith("--") and len(name) > 3 and option.startswith(name):
            skip = "=" not in tok
            continue
        out.append(tok)
    return out


def relaunch(argv: Sequence[str], nproc: int, *, module: str = "bridge.app.cli",
             environ: Mapping[str, str] | None = None) -> int:
    """Run ``python -m module *argv`` (``argv`` without ``--nproc``) under ``torchrun --standalone
    --nproc-per-node nproc`` and return its exit status. Each rank gets ``OMP_NUM_THREADS`` = this machine's
    cores / ``nproc`` unless ``OMP_NUM_THREADS`` is set already (``--threads`` still overrides it).
    ``ValueError`` when this process already runs under torchrun."""
    environ = dict(os.environ if environ is None else environ)
    if from_env(environ).launched or "TORCHELASTIC_RUN_ID" in environ:
        raise ValueError(f"--nproc starts torchrun itself, but this process already runs under a launcher "
                         f"(WORLD_SIZE={environ.get('WORLD_SIZE')}): drop --nproc")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {nproc!r}")
    environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", module, *strip_option(argv, "--nproc")]
    try:
        return subprocess.run(cmd, env=environ).returncode
    except KeyboardInterrupt:
        return 130
