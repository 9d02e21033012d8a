"""``qtransform quantize`` streamed (the default for a checkpoint directory, :mod:`bridge.app.driver`): a
checkpoint quantized shard to shard or block by block (:func:`bridge.stream.quantize_checkpoint`), never whole in
memory (the options both drivers share: :mod:`bridge.app.placement`).

``--resume`` continues a streamed run that was interrupted (same command, same inputs: anything else is
refused, naming what changed); ``--device`` runs the block being calibrated there (in memory: the whole model,
see :mod:`bridge.app.quantize`); ``--max-memory`` bounds the
calibration activations kept in memory (beyond, they go to disk). The perplexity after is measured on the
quantized checkpoint written; the original's by loading the float model whole (in float32, as in memory) when
:func:`bridge.app.driver.choose_driver` found that it fits the memory available, else the report says it was not
measured (``qtransform eval --model DIR`` measures it elsewhere).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from . import export, images, inputs, outputs
from .inputs import UserError
from .outputs import say, warn
from .placement import dtype_of

__all__ = ["cmd_streamed"]


def cmd_streamed(a, recipe, label: str, out: Path, source, t0: float, driver) -> int:
    from ..checkpoint import CheckpointError, store
    from ..distributed import current
    from ..stream import quantize_checkpoint
    from ..stream.driver import stored_dtypes_of
    from ..stream.sizing import format_size
    from . import evaluate, models, record, report

    name = a.model or models.DEFAULT_MODEL
    skeleton, plan = driver.prepared.model, driver.prepared.plan
    export.check_plan(a, plan, out, driver.prepared.inventory.carried)  # the --to target holds all, before any write
    for glob in recipe.unmatched(plan):
        warn(f"recipe pattern {glob!r} matches no tensor of the model")
    text = None if a.no_eval else inputs.corpus_text(a.corpus)
    calib_text = inputs.corpus_text(a.corpus, part="calibration") if a.calib else None
    if not a.no_eval or a.calib:
        inputs.check_seq_len(skeleton, a.seq_len)
    tokenizer = models.load_tokenizer(source)
    calibration = inputs.calibration(a, tokenizer, calib_text)
    pictures, notes = images.image_calibration(a, source.directory, skeleton, tokenizer, calib_text)
    calibration = pictures if pictures is not None else calibration
    eval_seqs = None if text is None else inputs.sequences(tokenizer, text, a.corpus, a.seq_len, a.eval_sequences)
    inputs.check_vocab(skeleton, eval_seqs, "evaluation text")
    inputs.check_vocab(skeleton, calibration, "calibration text")
    rows, rep = [], {}
    run = record.Run(model=name, label=label, recipe=recipe, out=out, driver=driver.why, t0=t0, eval_seqs=eval_seqs,
                     calibration=calibration, phases={"check": time.perf_counter() - t0}, notes=notes)
    stored = stored_dtypes_of(driver.prepared.src, skeleton)  # the bytes before of each row: the headers read once
    te = time.perf_counter()
    run.ppl_before = _original_perplexity(source, eval_seqs, driver, run.notes, parallel=current())
    if run.ppl_before is not None:
        run.phases["eval before"] = time.perf_counter() - te

    def on_tensor(path, w, q):
        rows.append(report.layer_row(path, w, q, "", error=a.layer_errors, stored=stored.get(path)))

    def before_publish(tmp: Path, result) -> None:
        ppl, te = None, time.perf_counter()
        run.phases["quantize"] = result.written.seconds
        run.notes.extend(record.carried_note(result.written.carried))
        if eval_seqs is not None and not driver.eval_after:
            run.notes.append(f"perplexity of the quantized checkpoint not measured: loading it whole does not fit "
                             f"the {format_size(driver.available)} available (`qtransform eval --model {out}` "
                             "measures it elsewhere)")
        elif eval_seqs is not None:
            say("perplexity of the quantized checkpoint ...")
            ppl = evaluate.perplexity(models.load_causal_lm(tmp), eval_seqs, progress=True).perplexity
            run.phases["eval after"] = time.perf_counter() - te
        layers = [dataclasses.replace(row, rule=result.plan[row.path].rule) for row in rows]
        w = result.written
        r = run.report(result, layers, size_before=w.bytes_in, size_after=w.bytes_out, seconds=w.seconds, ppl_after=ppl)
        record.write_report(a, run, r, tmp)
        rep["report"] = r

    say(f"quantizing {name} {driver.why} with {label} ({report.steps_label(recipe.steps)}) ...")
    try:
        done = quantize_checkpoint(source.directory, out, recipe, calibration=calibration, overwrite=a.overwrite,
                                   resume=a.resume, dtype=dtype_of(a), device=a.device or "cpu",
                                   max_memory=a.max_memory, recipe_name=label, tokenizer=tokenizer,
                                   progress=outputs.progress_bar(), on_tensor=on_tensor, before_publish=before_publish,
                                   all_experts=a.calibrate_all_experts)
    except CheckpointError as e:
        raise UserError(f"cannot load model {name}: {str(e).splitlines()[0]}") from None
    except FileExistsError as e:
        raise UserError(str(e)) from None
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise UserError(msg if msg.startswith("--") else f"recipe {label}: {msg}") from None
    except OSError as e:
        raise UserError(str(store.write_error(e, out))) from None
    if "report" not in rep:  # a rank other than 0 of a torchrun group: rank 0 writes and reports
        return 0
    record.publish_report(a, rep["report"], out,
                          f"resumed after {done.written.resumed} finished units" if done.written.resumed else "")
    return 0


def _original_perplexity(source, eval_seqs, driver, notes: list, parallel):
    """The float model's perplexity for a streamed run: the model loaded whole in float32 (as the in-memory run
    measures it) when that fits the memory available, else ``None`` with a note saying why."""
    import gc

    from ..stream.sizing import format_size
    from . import evaluate, models

    if eval_seqs is None:
        return None
    if not driver.eval_before:
        notes.append(f"perplexity of the original not measured: the float model loaded whole does not fit the "
                     f"{format_size(driver.available)} available (`qtransform eval --model` measures it elsewhere)")
        return None
    say(f"perplexity of the original on {eval_seqs.numel()} tokens ...")
    model = models.load_causal_lm(source)
    ppl = evaluate.perplexity(model, eval_seqs, progress=parallel.rank == 0, parallel=parallel).perplexity
    del model
    gc.collect()
    return ppl
