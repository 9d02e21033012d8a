"""The ``qtransform`` command run by the tests, two ways with one result type (``returncode``, ``stdout``,
``stderr``, as :class:`subprocess.CompletedProcess`):

- :func:`run_cli`: a real ``python -m bridge.app.cli`` process (offline, quiet). It is what a user runs
  (exit status, the whole of stderr, the interpreter's exit), and it pays the imports (bridge, transformers:
  seconds) each time: for the cases that check the process itself, and for plugins, which register for good.
- :func:`main_cli`: the same parser, checks and dispatch through ``bridge.app.cli.main(argv)`` in the test's
  process, its stdout and stderr captured: ``main`` returns the exit status (argparse's ``SystemExit``
  gives its code), so the result reads as the process's would. transformers' progress bars are off while
  it runs, as ``TQDM_DISABLE=1`` turns them off in :func:`run_cli`'s process (tqdm reads it at import).
"""

import contextlib
import io
import os
import subprocess
import sys

def run_cli(*args, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    """``python -m bridge.app.cli ARGS`` in a subprocess (this environment, offline and quiet)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    return subprocess.run([sys.executable, "-m", "bridge.app.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def main_cli(*args) -> subprocess.CompletedProcess:
    """``bridge.app.cli.main(ARGS)`` in this process, as a :func:`run_cli` result."""
    from transformers.utils import logging as tf_logging

    from bridge.app.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    bars = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except SystemExit as e:  # argparse: bad arguments (2), --help (0)
        rc = e.code if isinstance(e.code, int) else 1
    finally:
        if bars:
            tf_logging.enable_progress_bar()
    return subprocess.CompletedProcess(["qtransform", *argv], rc, out.getvalue(), err.getvalue())


def one_line_error(res, *needles) -> str:
    """``res`` failed with exactly one line on stderr, ``qtransform: error: ...`` holding every needle."""
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr and lines[0].startswith("qtransform: error:")
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]
