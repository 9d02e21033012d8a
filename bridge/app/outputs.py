"""Where the ``qtransform`` command writes: every target is checked before any work starts (a
model can take minutes to load and evaluate), and files are written under a temporary name and
renamed, so a failure never leaves half a file. Every failure is a one-line :class:`UserError`.
What the command says goes to stdout (:func:`say`), its warnings to stderr (:func:`warn`).

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> (d / "a-file").write_text("x")
1
>>> check_out_dir(d / "a-file" / "ckpt", overwrite=False)
Traceback (most recent call last):
...
bridge.app.inputs.UserError: --out .../a-file/ckpt: .../a-file is a file, not a directory
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from .inputs import UserError

__all__ = ["check_out_dir", "check_file_target", "write_text", "say", "warn", "progress_bar"]


def say(msg: str = "") -> None:
    """A line on stdout, flushed (progress and results)."""
    print(msg, flush=True)


def warn(msg: str) -> None:
    """A ``qtransform: warning: ...`` line on stderr (from rank 0 only, under torchrun: the ranks run the same
    command, and their stdout is silenced by :func:`bridge.distributed.launch.quiet`)."""
    from ..distributed import launch

    if launch.is_main():
        print(f"qtransform: warning: {msg}", file=sys.stderr, flush=True)


def _existing_ancestor(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            return p
    return Path(".")  # pragma: no cover  (the root always exists)


def _probe(option: str, path: Path, directory: Path) -> None:
    """``directory`` (an existing one) must take new entries: tried for real, since permission
    bits say nothing for root, read-only mounts or ``/proc``."""
    if not directory.is_dir():
        raise UserError(f"{option} {path}: {directory} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(dir=directory, prefix=".qtransform-probe-"))
    except OSError as e:
        raise UserError(f"{option} {path}: cannot write in {directory} ({e.strerror or e})") from None


def check_out_dir(out: Path, *, overwrite: bool, option: str = "--out") -> None:
    """The checkpoint directory ``out``: absent, or an empty directory, or any directory with
    ``overwrite``; its nearest existing parent must take new entries (``out`` is assembled next to
    it and renamed). Nothing is created."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserError(f"{option} {out} is a file, not a directory")
        if any(out.iterdir()) and not overwrite:
            raise UserError(f"output directory {out} exists and is not empty (pass --overwrite to replace it)")
    _probe(option, out, _existing_ancestor(out.absolute().parent))


def check_file_target(path: Path, *, option: str) -> None:
    """A file the command will write (``--json``): its directory must exist and take new entries;
    the path must not be a directory. Nothing is created."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {path} is a directory, not a file")
    parent = path.absolute().parent
    if not parent.exists():
        raise UserError(f"{option} {path}: directory {parent} does not exist")
    _probe(option, path, parent)


def write_text(path: Path, text: str, *, option: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory (created with the
    umask's permissions, as an ordinary file), then rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"{option} {path}: cannot write it ({e.strerror or e})") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def progress_bar():
    """A ``progress(iterable, desc=..., total=...)`` wrapper with a tqdm bar on stderr (rank 0's only)."""
    from tqdm.auto import tqdm

    from ..distributed import launch

    off = not launch.is_main()
    return lambda it, desc="", total=None: tqdm(it, total=total, desc=desc, file=sys.stderr, leave=False,
                                                dynamic_ncols=True, disable=off)
