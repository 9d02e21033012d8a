"""The specs the property tests run on: every registered format, granularity and symmetry
(:func:`qtransform.testing.spec_cases`, registry-driven: a new format is a new test id), as pytest parameters."""

from qtransform.testing import spec_cases

CASES = spec_cases()
IDS = [case_id for case_id, _ in CASES]
SPECS = [spec for _, spec in CASES]
