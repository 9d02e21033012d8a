"""Settings of the whole run (tests/, property_tests/ and the doctests of qtransform/ and bridge/).

Under pytest-xdist (``make test`` runs two workers) each worker is a process with torch's default of one
thread per core, so the workers' OpenMP threads contend for the same cores, and small operations spinning
on busy cores multiply the time (SignRound's three presets in test_module_edges.py: 6 s at one thread,
72 s at torch's default of two on a loaded 2-core machine). Each worker gets its share of the cores (at
least one thread), and its subprocesses the same through ``OMP_NUM_THREADS``; a value the user set is kept.
"""

import os

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)

if os.environ.get("PYTEST_XDIST_WORKER") and _WORKERS > 0 and "OMP_NUM_THREADS" not in os.environ:
    import torch

    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)
