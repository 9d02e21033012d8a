"""Issue 51, part 6, the exports: every model type of the walk (:mod:`.test_every_model_type`: the same entries, tiny
random models, ``int4-g32``, the same ``SUBSET`` unmarked but its ``SLOW`` exports, the rest marked long), saved once
with ``bridge.save``, goes through every registered exporter (:data:`bridge.interop.EXPORTERS`: a new target is walked
by itself). Each export is written and read back, or refused by name:

- written: the format's importer (:func:`bridge.interop.detect_format`) reads back the checkpoint's very tree
  (every QTensor dequantizing to the same values, float tensors equal) and, where the model has a text forward,
  ``load_imported`` gives the quantized model's logits; an ONNX export (no importer) is run by ONNX Runtime, which
  decodes every quantized weight bit for bit and gives those logits;
- refused: a ``ValueError`` naming a tensor or module path, the model class or type, with nothing written.

A refusal whose every item is "nearest" (the target holds the spec only approximately, e.g. GGUF's Q4_1 for
float32-scaled int4) is then exported with ``allow_nearest=True``, which must write (the importer's tree within a
relative RMS bound of ours, the logits finite) or refuse by name for another reason.

Any other exception is a failure. Failures found and not fixed here are :data:`KNOWN` (strict xfail, with the
cause). Each test records its outcome (``record_property``: ``--junitxml`` has them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch import nn

import bridge
from bridge import interop

from .export_checks import imported_logits, near_import, refusal_names, same_import, same_onnx
from .test_every_model_type import NO_TEXT_FORWARD, RECIPE, SUBSET, UNBUILDABLE, WALKED
from .tiny_any import ENTRIES, build, tokens
from .walk_checks import close, family, logits, named

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")

TARGETS = list(interop.EXPORTERS)

#: failures found by the walk, not fixed here: {(entry id, target): the cause}; strict, so that a fix is noticed
KNOWN: dict[tuple[str, str], str] = {}


class Saved(NamedTuple):
    id: str
    model: nn.Module
    kind: str
    qmodel: nn.Module | None  # None: refused (``refusal``) or crashed (``error``)
    ckpt: Path | None
    refusal: str | None
    error: BaseException | None


#: exports of the subset that take most of its time (ONNX of a hybrid with vision, of a Mamba hybrid, ~75 s):
#: make test-long / test-walk; their families' other exports and tests/bridge/interop/test_vlm_exports.py stay
SLOW = {("qwen3_5-vlm", "onnx"), ("bamba", "onnx")}


def pytest_generate_tests(metafunc):
    """(entry, target) pairs: the subset's in ``make test`` (but ``SLOW``), every other pair marked long."""
    if {"saved", "to"} <= set(metafunc.fixturenames):
        metafunc.parametrize(("saved", "to"), [
            pytest.param(e, to, id=f"{e}-{to}", marks=() if e in SUBSET and (e, to) not in SLOW else pytest.mark.long)
            for e in WALKED for to in TARGETS], indirect=["saved"], scope="module")


@pytest.fixture(scope="module")
def saved(request, tmp_path_factory):
    entry = ENTRIES[request.param]
    model = build(entry)
    kind = family(entry, model)
    try:
        qmodel = bridge.quantize(model, RECIPE, kernel="dequant")
    except ValueError as e:
        return Saved(request.param, model, kind, None, None, str(e), None)
    except Exception as e:  # noqa: BLE001  (a crash: each test fails with it)
        return Saved(request.param, model, kind, None, None, None, e)
    ckpt = tmp_path_factory.mktemp(re.sub(r"\W", "_", request.param)) / "q"
    bridge.save(qmodel, ckpt)
    return Saved(request.param, model, kind, qmodel, ckpt, None, None)


def _want(w: Saved):
    """The quantized model's logits on two rows of token ids, or None when it has no text forward."""
    if w.id in NO_TEXT_FORWARD:
        return None
    return logits(w.qmodel, tokens(w.model, batch=2))


def _export(w: Saved, to: str, out: Path, *, allow_nearest: bool = False) -> str | None:
    """Export; None when written, else the refusal (checked: named, nothing written)."""
    try:
        interop.export(w.ckpt, to=to, out=out, allow_nearest=allow_nearest)
    except ValueError as e:
        assert not out.exists(), f"refused but wrote {out}: {e}"
        assert refusal_names(str(e), w.model, (w.ckpt, out), named), f"refused without naming what: {e}"
        return str(e)
    return None


def _nearest_only(refusal: str) -> bool:
    items = refusal.split("\n  ")[1:]
    return bool(items) and all("allow_nearest=True" in i for i in items if not i.startswith("... and"))


def _read_back(w: Saved, to: str, out: Path, *, exact: bool) -> str:
    """The export read back and compared with the checkpoint; what was found, for the record."""
    ids = tokens(w.model, batch=2)
    want = _want(w)
    fmt = interop.detect_format(out)
    if fmt is None:
        assert to == "onnx", f"no importer reads the {to} export and no other check knows it"
        assert exact
        same_onnx(out, w.ckpt, ids, want)
        return "written, ONNX Runtime decodes our weights" + ("" if want is None else " and gives our logits")
    assert fmt in interop.IMPORTERS
    if exact:
        same_import(fmt, out, w.ckpt)
    else:
        err = near_import(fmt, out, w.ckpt)
    if want is None:
        return f"written, re-imported by {fmt}"
    got = imported_logits(out, ids, w.model.config._attn_implementation)
    if exact:
        close(got, want)
        return f"written, re-imported by {fmt} with our logits"
    assert got.shape == want.shape and torch.isfinite(got).all()
    return f"written (nearest, worst relative RMS {err:.3f}), re-imported by {fmt}"


def _known(request, entry: str, check: str) -> None:
    why = KNOWN.get((entry, check))
    if why is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=why))


def test_every_export_is_written_and_read_back_or_refused_by_name(saved, to, record_property, request, tmp_path):
    _known(request, saved.id, to)
    record_property("kind", saved.kind)
    if saved.error is not None:
        raise saved.error
    if saved.qmodel is None:
        assert named(saved.refusal, saved.model), f"refused without naming a tensor, module or the model: {saved.refusal}"
        record_property("outcome", f"not quantized: {saved.refusal}")
        return
    refusal = _export(saved, to, tmp_path / to)
    if refusal is None:
        record_property("outcome", _read_back(saved, to, tmp_path / to, exact=True))
        return
    if not _nearest_only(refusal):
        record_property("outcome", f"refused: {refusal}")
        return
    again = _export(saved, to, tmp_path / f"{to}-nearest", allow_nearest=True)
    if again is not None:
        assert "allow_nearest=True" not in again, f"refused as nearest with allow_nearest: {again}"
        record_property("outcome", f"refused: {refusal.splitlines()[0]}; with allow_nearest: {again}")
        return
    record_property("outcome", "refused as nearest; with allow_nearest "
                    + _read_back(saved, to, tmp_path / f"{to}-nearest", exact=False))


def test_the_export_walk_covers_every_target_and_the_same_types():
    assert {"compressed-tensors", "quark", "gguf", "onnx"} <= set(TARGETS)
    assert not set(UNBUILDABLE) & set(WALKED) and set(SUBSET) <= set(WALKED)
    assert {e for e, _ in SLOW} <= set(SUBSET) and {t for _, t in SLOW} <= set(TARGETS)
    assert {e for e, _ in KNOWN} <= set(WALKED) and {t for _, t in KNOWN} <= set(TARGETS)
