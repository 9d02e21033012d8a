"""``qtransform quantize`` on several processes: under ``torchrun`` (one process per rank), or ``--nproc N``
(the command starts torchrun itself). See docs/distributed.md.

Under torchrun the command initialises the default process group from torchrun's environment
(:func:`bridge.distributed.launch.init`: gloo, or NCCL with ``--device cuda``), and the pipeline shares the
calibration and the solves over it by itself. Rank 0 alone writes and speaks; the other ranks are quiet but
for their own error. ``--dist-timeout`` bounds how long a rank waits for the others in a collective.
"""

from __future__ import annotations

import contextlib

from ..distributed import launch
from .inputs import UserError

__all__ = ["add_options", "group", "relaunch", "error_text"]


def add_options(q, at_least) -> None:
    q.add_argument("--nproc", type=at_least(1), metavar="N",
                   help="run on N processes on this machine: the same command under torchrun (python -m "
                        "torch.distributed.run --standalone --nproc-per-node N); each gets cores/N threads unless "
                        "OMP_NUM_THREADS or --threads says otherwise")
    q.add_argument("--dist-timeout", type=at_least(1), default=launch.DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"under torchrun: how long a rank waits for the others before failing (default "
                        f"{launch.DEFAULT_TIMEOUT})")


@contextlib.contextmanager
def group(a):
    """The process group of torchrun's environment for the commands that use it (``quantize``), initialised
    around the command and destroyed after it (:func:`bridge.distributed.launch.teardown`); the ranks but 0 are
    made quiet."""
    if a.command != "quantize":
        yield
        return
    try:
        env = launch.init(getattr(a, "device", None), timeout=getattr(a, "dist_timeout", launch.DEFAULT_TIMEOUT))
    except ValueError as e:
        raise UserError(str(e)) from None
    if env.world > 1 and not launch.is_main():
        launch.quiet()
    try:
        yield
    except BaseException:
        launch.teardown(failed=True)
        raise
    launch.teardown()


def relaunch(a, argv: list[str]) -> int:
    """``--nproc N``: the same command under torchrun, its exit status (N = 1: ``None``, run here)."""
    if a.nproc == 1 and not launch.from_env().launched:
        return None
    try:
        return launch.relaunch(argv, a.nproc)
    except ValueError as e:
        raise UserError(str(e)) from None


def error_text(e: BaseException) -> str | None:
    """The words for a collective that failed because another rank is gone (``None`` for other errors)."""
    text = str(e)
    lost = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out")
    import torch.distributed as dist

    if any(s in text for s in lost) or isinstance(e, getattr(dist, "DistError", ())):
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        if "] " in first:  # gloo's "[.../pair.cc:553] Connection closed by peer ..." without the source place
            first = first.split("] ", 1)[1]
        return f"stopped: another rank failed, left or hangs (see its message): {first.split('. ')[0]}"
    return None
