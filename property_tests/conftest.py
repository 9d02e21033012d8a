"""Hypothesis profiles: ``ci`` (derandomized, the default for `make test`) and ``dev`` (more examples).

Choose with ``HYPOTHESIS_PROFILE=dev``. This folder is put on ``sys.path`` for its helper module
``independent_grid`` (pytest runs with ``--import-mode=importlib``, which adds no test folders).
"""

import os
import sys

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=12, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=200, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

if os.path.dirname(__file__) not in sys.path:
    sys.path.insert(0, os.path.dirname(__file__))
