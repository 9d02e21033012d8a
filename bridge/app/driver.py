"""Which driver ``qtransform quantize`` runs, chosen before anything is loaded, and whether the machine has the
memory for it.

A transformers checkpoint directory of safetensors shards is **streamed** (:mod:`bridge.stream`: shard to shard
or block by block, as the recipe needs) unless ``--in-memory`` says otherwise; the in-memory driver takes the
rest: the default model and any GGUF file, another tool's quantized checkpoint (its values are dequantized
first), and what the streamed driver refuses (:class:`bridge.stream.accept.CannotStream`: low-rank corrections,
a step learning on the whole model's loss...), with the reason in the report. ``--stream`` insists on
streaming: a run it cannot stream is an error naming why.

Then the peak memory of the chosen path is estimated from ``config.json`` and the plan
(:mod:`bridge.stream.sizing`) and compared with what this machine has: a run that cannot fit is refused with
its estimate and the way out, instead of being killed by the kernel minutes later (``--no-memory-check``
runs it anyway). The perplexities of the original and of the checkpoint written, which a streamed run measures
by loading each model whole, are skipped (said in the report) when that load does not fit.
"""

from __future__ import annotations

from typing import NamedTuple

from .inputs import UserError

__all__ = ["Driver", "choose_driver"]


class Driver(NamedTuple):
    """The chosen driver: ``streamed`` or not, ``why`` (a line of the report), the estimated ``peak``
    (:class:`~bridge.stream.sizing.Estimate`, ``None`` where the model's config cannot be read ahead), the
    memory ``available``; for a streamed run whether the evaluations of the float model and of the checkpoint
    written, each loading a model whole, fit (``eval_before``, ``eval_after``: a run whose evaluation does not fit
    goes on without it, and the report says so) and what :func:`bridge.stream.accept.accepted_run` found
    (``prepared``)."""

    streamed: bool
    why: str
    peak: object = None
    available: int | None = None
    eval_before: bool = True
    eval_after: bool = True
    prepared: object = None


def _streams(plan) -> int:
    """Calibrated passes over the model: one per step that needs data, one for static activation scales."""
    import qtransform as qt

    steps = sum(qt.get_algorithm(s.name).needs is not None for s in plan.steps)
    static = any(not spec.dynamic for spec in plan.activations.values())
    return max(1, steps + static)


def choose_driver(a, recipe, label: str, source, *, task=None) -> Driver:
    """The driver of ``qtransform quantize`` (see the module docstring); ``UserError`` for a run that cannot
    fit this machine's memory or that ``--stream`` cannot stream. ``task``: the run's
    :class:`~bridge.app.tasks.Task` (every task but causal-lm runs in memory)."""
    from ..checkpoint import CheckpointError
    from ..checkpoint.store import parse_size
    from ..stream import accept, sizing
    from . import inputs, loadcheck, placement, tasks

    name = a.model or "the default model"
    streaming_options = [o for o, v in (("--resume", a.resume), ("--max-memory", a.max_memory)) if v]
    other = task is not None and task.name != "causal-lm"
    cannot = "--in-memory" if a.in_memory else (f"the {task.name} task runs in memory" if other else
                                                 placement.source_refusal(source))
    prep = None
    if cannot is None:
        try:
            loadcheck.check_quantized_without_config(source)  # codes without their config: refused as loading does
            prep = accept.accepted_run(source.directory, recipe, calibrated=bool(a.calib))
        except accept.CannotStream as e:
            cannot = str(e)
        except CheckpointError as e:
            raise UserError(f"cannot load model {name}: {str(e).splitlines()[0]}") from None
        except (TypeError, ValueError) as e:
            raise UserError(f"recipe {label}: {e}") from None
    if cannot is not None and a.stream:
        raise UserError(f"--stream: {name} cannot be streamed: {cannot}")
    if cannot is not None and streaming_options:
        raise UserError(f"{', '.join(streaming_options)} go with a streamed run (a checkpoint directory, or --stream); "
                        f"{name} runs in memory: {cannot}")
    free = sizing.available()
    evaluating = not a.no_eval
    if prep is not None:
        tokens = a.calib * a.seq_len if a.calib else 0
        run = sizing.streamed(prep.model, prep.plan, block_by_block=not prep.tensor_run, tokens=tokens,
                              streams=_streams(prep.plan), max_memory=parse_size(a.max_memory) if a.max_memory else None)
        loaded = sizing.evaluation(prep.model, seq_len=a.seq_len).total if evaluating else 0
        fits = evaluating and (free is None or loaded <= free)  # else the run goes on and the report says why
        why = "--stream" if a.stream else "the default for a checkpoint directory"
        driver = Driver(True, f"streamed {prep.mode} ({why})", run, free, eval_before=fits, eval_after=fits,
                        prepared=prep)
        _check(a, driver, name, way_out=_stream_way_out(a))
        return driver
    skeleton = inputs.skeleton(source, tasks.model_class(task, source) if other else None)
    peak = None if skeleton is None else sizing.in_memory(skeleton, calibrated=bool(a.calib),
                                                          seq_len=a.seq_len if evaluating else None)
    why = "--in-memory" if a.in_memory else (cannot if a.model else "the default model is a GGUF file")
    driver = Driver(False, f"in memory ({why})", peak, free)
    _check(a, driver, name, way_out="quantize it streamed (without --in-memory)" if a.in_memory else
           "quantize it on a machine with more memory, or from a safetensors checkpoint directory, which streams")
    return driver


def _stream_way_out(a) -> str:
    ways = []
    if a.calib:
        ways.append("--max-memory SIZE (calibration activations beyond it spill to disk) or a smaller --calib")
    return "; ".join(ways) or "a machine with more memory"


def _check(a, driver: Driver, name: str, *, way_out: str) -> None:
    from ..stream.sizing import format_size

    if a.no_memory_check or driver.peak is None or driver.available is None:
        return
    if driver.peak.total > driver.available:
        raise UserError(f"quantizing {name} {driver.why} needs about {driver.peak.describe()}; this machine has "
                        f"{format_size(driver.available)} available: {way_out} (--no-memory-check runs it anyway)")
