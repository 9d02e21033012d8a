"""The specs the property tests run on: every registered format, granularity and symmetry
(:func:`qtransform.testing.spec_cases`, registry-driven: a new format is a new test id), as pytest parameters.

``PARAMS`` are the same cases as pytest parameters with the whole matrix split in two: a covering set that
``make test`` runs — every (format, symmetry) pair and every (granularity, symmetry) pair at least once, so
every format, every zero-point form and every granularity is exercised — and the rest, marked ``long``
(``make test-long`` runs the whole registry matrix)."""

import pytest

from qtransform.testing import spec_cases

CASES = spec_cases()
IDS = [case_id for case_id, _ in CASES]
SPECS = [spec for _, spec in CASES]


def covering_params(cases) -> list:
    """``cases`` (``(test_id, spec)`` pairs of ``spec_cases``) as pytest parameters, those that add no new
    (format, symmetry) or (granularity, symmetry) pair to the ones before them marked ``long``."""
    formats, grans, out = set(), set(), []
    for case_id, spec in cases:
        sym = case_id.rsplit("-", 1)[-1]
        granularity = case_id[len(spec.format) + 1:].rsplit("-", 1)[0]
        new = (spec.format, sym) not in formats or (granularity, sym) not in grans
        out.append(pytest.param(spec, id=case_id, marks=() if new else pytest.mark.long))
        formats.add((spec.format, sym))
        grans.add((granularity, sym))
    return out


PARAMS = covering_params(CASES)
