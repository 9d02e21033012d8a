"""The one record of a ``qtransform quantize`` run, whichever driver ran it, and the report built from it.

Both drivers (in memory, :mod:`.quantize`; streamed, :mod:`.streaming`) fill a :class:`Run` with what the command
knew before quantizing (model, recipe, driver, evaluation and calibration data, the original's perplexity, notes,
phases) and end with the same :class:`~bridge.tree.Quantized` result (a streamed one says where its tensors went);
:meth:`Run.report` builds the report from the two, :func:`write_report` puts it beside the checkpoint and
:func:`publish_report` writes ``--json``, exports (``--to``) and prints it, the same way for both.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import qtransform as qt

from . import export, outputs
from .outputs import say
from .report import Report, activation_rows, online_rows, peak_memory

__all__ = ["Run", "calib_tokens", "write_report", "publish_report", "carried_note", "kept_notes", "nearest_notes"]


@dataclasses.dataclass
class Run:
    """What one run knew before quantizing: ``model`` (its name), ``label`` and ``recipe``, ``out``, the ``driver``
    line, the evaluation sequences and calibration batches, the original's perplexity, ``notes`` (what the run
    left out on purpose) and ``phases`` (seconds of each phase, in order), and ``t0``, when the command started."""

    model: str
    label: str
    recipe: qt.Recipe
    out: Path
    driver: str
    t0: float
    eval_seqs: Any = None
    calibration: Any = None
    ppl_before: float | None = None
    notes: list = dataclasses.field(default_factory=list)
    phases: dict = dataclasses.field(default_factory=dict)

    def report(self, result, rows: list, *, size_before: int, size_after: int, seconds: float,
               ppl_after: float | None, **extra) -> Report:
        """The report of ``result`` (the run's :class:`~bridge.tree.Quantized`, its trees may be empty) and its
        quantized tensors' ``rows``; ``extra``: the driver's own fields (low-rank corrections)."""
        written = result.written
        return Report(model=self.model, recipe=self.label, steps=[s.to_dict() for s in self.recipe.steps],
                      layers=rows, size_before=size_before, size_after=size_after, seconds_quantize=seconds,
                      ppl_before=self.ppl_before, ppl_after=ppl_after,
                      eval_tokens=0 if self.eval_seqs is None else int(self.eval_seqs.numel()),
                      calib_tokens=calib_tokens(self.calibration),
                      out=str(self.out), unmatched=self.recipe.unmatched(result.plan),
                      activations=activation_rows(result.activations), step_info=result.info,
                      online=online_rows(result.online), streamed=written.mode if written is not None else "",
                      driver=self.driver, notes=list(self.notes) + kept_notes(result.plan) + nearest_notes(result), phases=self.phases,
                      peak_memory=peak_memory(),
                      **extra)


def calib_tokens(calibration) -> int:
    """Tokens of the calibration batches (tensors of token ids, or dicts with ``input_ids``; images count none)."""
    ids = [b.get("input_ids") if isinstance(b, dict) else b for b in calibration or ()]
    return sum(int(t.numel()) for t in ids if t is not None)


def write_report(a, run: Run, rep: Report, directory: Path) -> None:
    """``report.json`` (and ``report.png`` with ``--plot``) into the checkpoint's ``directory``, before it
    appears; the total seconds measured now."""
    rep.seconds_total = time.perf_counter() - run.t0
    (directory / "report.json").write_text(json.dumps(rep.to_dict(), indent=2) + "\n")
    if a.plot:
        rep.plot(directory / "report.png")


def publish_report(a, rep: Report, out: Path, *lines: str) -> None:
    """After the checkpoint appeared: ``--json``, the ``--to`` export, and the report printed (with ``lines``)."""
    if a.json:
        outputs.write_text(Path(a.json), json.dumps(rep.to_dict(), indent=2) + "\n", option="--json")
    exported = export.export_after_quantize(a, out)
    say()
    say("\n".join([rep.render(), *[line for line in lines if line],
                   *([f"exported ({a.to}): {exported}"] if exported else [])]))


def carried_note(names) -> list:
    """The report's line on the stored tensors carried as they are (none: no line)."""
    if not names:
        return []
    heads = sorted({".".join(n.split(".")[:3 if n.startswith(("model.layers.", "layers.")) else 2]) for n in names})
    return [f"kept as stored: {len(names)} tensor(s) of the input that the model class does not load "
            f"({', '.join(heads[:4])}{', ...' if len(heads) > 4 else ''}): written unchanged, checked present"]


def kept_notes(plan) -> list:
    """One line per reason the plan keeps tensors in float on purpose (its ``skipped (...)`` rules: a multimodal
    model's towers, routers, float32 modules...), with the count and a first path: nothing is left out unsaid."""
    if plan is None:
        return []
    by: dict = {}
    for path, m in plan.items():
        if m.spec is None and m.rule.startswith("skipped ("):
            by.setdefault(m.rule[len("skipped ("):-1], []).append(path)
    return [f"kept in float: {len(paths)} tensor(s) (e.g. {paths[0]}): {why}" for why, paths in sorted(by.items())]


def nearest_notes(result) -> list:
    """The line on quantized tensors that a recipe with calibrated steps left to round to nearest (no step
    reported fitting them: outside the blocks a block-by-block step runs on, such as a head a rule selects)."""
    import qtransform as qt

    plan = result.plan
    if plan is None or not any(qt.get_algorithm(s.name).needs is not None for s in plan.steps):
        return []
    left = [p for p in plan.specs if p not in result.info]
    if not left:
        return []
    return [f"round to nearest: {len(left)} quantized tensor(s) no calibrated step fitted (e.g. {left[0]}): outside "
            "the blocks the recipe's steps calibrate"]
