"""``qtransform quantize``: a model and a recipe in, a checkpoint with its report out, on the library's
pipeline.

The run checks first whatever it can without the weights: the recipe (``--algorithm`` and
``--kv-cache`` applied), its steps and the calibration data they and its static activation specs
need (:func:`bridge.pipeline.check_calibration`, the library's own rule), where the outputs go,
and the recipe against the shapes of ``config.json``. Then the driver is chosen
(:func:`bridge.app.driver.choose_driver`: a checkpoint directory streams, :mod:`bridge.app.streaming`; the rest runs
in memory here) and its peak memory checked against the machine's. In memory, the model is resolved (where it
lives and in which format) and loaded once, planned (:func:`bridge.plan`), quantized by
:func:`bridge.quantize_params` and rebuilt by :func:`bridge.to_module` of that result: the very
functions :func:`bridge.quantize` runs, so the command and the library make the same model.

``--device cuda`` moves the loaded model there whole for the perplexities and the steps, and the result back
to the host (:func:`bridge.app.placement.to_host`) before the quantized model is built and written: the
checkpoint is written as without ``--device``.

The checkpoint, ``report.json`` and the plot are written inside one
:func:`bridge.checkpoint.store.atomic_directory`: nothing half-written appears under ``--out``,
and a killed run leaves a temporary directory that the next save to the same place removes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path

from . import driver as drivers
from . import export, images, inputs, outputs, placement, streaming
from .inputs import UserError
from .outputs import say, warn

__all__ = ["cmd_quantize", "recipe_of"]


def _plan(model, recipe, label: str, calibrated: bool):
    """The recipe resolved for ``model`` (a skeleton on the meta device works too) by the pre-run check of both
    drivers (:func:`bridge.pipeline.prepare`): a rule hitting a tensor it cannot quantize, a grid its shape does
    not fit, no tensor selected or a step that cannot run on it is an error."""
    from .. import pipeline

    try:
        return pipeline.prepare(model, recipe, calibrated=calibrated)
    except (TypeError, ValueError) as e:
        raise UserError(f"recipe {label}: {e}") from None


def recipe_of(a):
    """``(recipe, label, stem)`` of ``--recipe`` with ``--algorithm`` and ``--kv-cache`` applied, its
    steps and static activation specs checked against ``--calib`` (nothing loaded yet)."""
    import qtransform as qt
    from .. import pipeline

    preset = inputs.load_recipe(a.recipe)
    recipe, label = preset.recipe, preset.name
    if a.algorithm and recipe.steps != (qt.Step(a.algorithm),):  # the recipe's steps give way to one step
        recipe = dataclasses.replace(recipe, steps=(qt.Step(a.algorithm),))
    rank = getattr(a, "lowrank", None)
    if rank:  # --lowrank: one more step, weighted by the input Hessians where there is calibration data
        recipe = dataclasses.replace(recipe, steps=(*recipe.steps, qt.Step("lowrank", rank=rank, weighted=bool(a.calib))))
        label = f"{label} + lowrank {rank}"
    try:
        qt.check_steps(recipe.steps, calibrated=bool(a.calib))
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    stem = Path(preset.name).stem + (f"-lowrank{rank}" if rank else "")
    if a.kv_cache:
        try:
            fmt, _, per = a.kv_cache.partition(":")  # FORMAT[:head]: one scale per key/value head
            if per not in ("", "head"):
                raise ValueError(f"the scales are per tensor (FORMAT) or per key/value head (FORMAT:head), not {per!r}")
            gran = qt.PerChannel(1) if per else qt.PerTensor()
            recipe = dataclasses.replace(recipe, kv_cache=qt.QuantSpec(format=fmt, granularity=gran))
        except (TypeError, ValueError) as e:
            raise UserError(f"--kv-cache {a.kv_cache}: {e}") from None
        stem, label = f"{stem}-kv-{a.kv_cache.replace(':', '-')}", f"{label} + kv_cache {a.kv_cache}"
    try:
        pipeline.check_calibration(recipe, calibrated=bool(a.calib))
    except ValueError as e:
        raise UserError(f"recipe {label}: {e}") from None
    return recipe, label, stem


def _prepare(a, recipe, label, source, out, task):
    """The corpus read, the model loaded (on ``--device``), the evaluation and calibration data (image-text pairs
    for a vision-language model: :mod:`.images`; the task's own for the others: :mod:`.task_eval`), the plan, the
    dtypes to write and the stored ones, the input's inventory and the report's notes so far: ``(model, tokenizer,
    device, eval_seqs, probe, calibration, plan, dtypes, stored, inventory, notes)`` (``tokenizer``: the task's
    processor; ``probe``: the held-out inputs of a task other than causal-lm, ``eval_seqs`` those of a causal LM)."""
    from . import models, task_eval, tasks

    causal, text_task = task.name == "causal-lm", task.modality == "text"
    text = None if a.no_eval or not text_task else inputs.corpus_text(a.corpus)
    calib_text = inputs.corpus_text(a.corpus, part="calibration") if a.calib and text_task else None
    skeleton = inputs.skeleton(source, tasks.model_class(task, source))
    if skeleton is not None:  # shapes and selection from config.json alone
        _plan(skeleton, recipe, label, bool(a.calib))
        if text_task and (not a.no_eval or a.calib):
            inputs.check_seq_len(skeleton, a.seq_len)
        del skeleton

    imported = None if a.model is None else source.imported
    say(f"loading {a.model or models.DEFAULT_MODEL}" + ("" if causal else f" for {task.name}")
        + (f" ({imported} checkpoint, dequantized: the recipe starts from its values)" if imported else "") + " ...")
    if causal:
        model, tokenizer = inputs.model_and_tokenizer(a.model, source=source, dequantize_imported=True)
    else:
        model, tokenizer = tasks.load(task, source)
    device = placement.run_device(a)
    if device is not None:  # the whole model there for the perplexities and the steps (calibration batches follow)
        model.to(device)
    if text_task and (not a.no_eval or a.calib):
        inputs.check_seq_len(model, a.seq_len)
    probe, eval_seqs = None, None
    if causal:
        eval_seqs = None if a.no_eval else inputs.sequences(tokenizer, text, a.corpus, a.seq_len, a.eval_sequences)
        calibration = inputs.calibration(a, tokenizer, calib_text)
        pictures, notes = images.image_calibration(a, source.directory if source.gguf_file is None else None, model,
                                                   tokenizer, calib_text)
        calibration = pictures if pictures is not None else calibration
        inputs.check_vocab(model, eval_seqs, "evaluation text")
        inputs.check_vocab(model, calibration, "calibration text")
    else:
        probe = task_eval.probe(a, task, model, tokenizer, text)
        calibration, notes = task_eval.calibration(a, task, model, tokenizer, calib_text)
    plan = _plan(model, recipe, label, bool(a.calib))
    inventory = _inventory(source, model) if causal or type(model).__name__ in tasks.architectures(source) else None
    _check_rules(plan.recipe, inventory.carried if inventory else ())
    export.check_plan(a, plan, out, inventory.carried if inventory else ())
    dtypes = placement.stored_dtypes(a, source, model)  # of the float model: its tied tensors still tied
    # as the input stores them, the report's "before" (the same map unless --dtype changes what is written)
    stored = dtypes if a.dtype == "auto" else placement.stored_dtypes(a, source, model, dtype="auto")
    return model, tokenizer, device, eval_seqs, probe, calibration, plan, dtypes, stored, inventory, notes


def _check_rules(recipe, carried) -> None:
    from ..stream.inventory import check_rules

    try:
        check_rules(recipe, carried)
    except ValueError as e:
        raise inputs.UserError(str(e)) from None


def _inventory(source, model):
    """The input checkpoint's tensors, each loaded into the model or carried as stored
    (:func:`bridge.stream.inventory.take`); for another tool's checkpoint the carried tensors its importer read
    (:class:`bridge.stream.inventory.Carried`: our compressed-tensors or Quark export of a checkpoint with MTP
    layers); ``None`` for a GGUF file or a checkpoint without them (read whole by their importers)."""
    from ..checkpoint.config_file import read_config
    from ..checkpoint.store import INDEX, SINGLE
    from ..stream.inventory import Carried, take

    d = source.directory
    if source.gguf_file is None and source.imported is not None:
        carried = getattr(model, "_qt_carried", None)
        return Carried(carried) if carried else None
    if source.gguf_file is not None or not ((d / INDEX).is_file() or (d / SINGLE).is_file()):
        return None
    if "quantization_config" in read_config(d / "config.json"):  # a quantized checkpoint: its loader checks it
        return None
    return take(d, model)



def cmd_quantize(a) -> int:
    import torch

    from .. import io, pipeline
    from ..checkpoint import store
    from ..distributed import current, launch
    from ..tree import extract, to_module
    from ..step_outputs import output_bytes, read_outputs, records
    from . import evaluate, models, record, report, tasks

    t0 = time.perf_counter()
    main = launch.is_main()  # under torchrun: rank 0 alone writes and speaks (docs/distributed.md)
    # everything that can be checked without the weights, before minutes of loading and evaluating; under
    # torchrun the ranks agree at the end of each stage, so a rank failing there stops all with its message
    with launch.stage():
        recipe, label, stem = recipe_of(a)
        model_name = Path(a.model).stem if a.model else models.DEFAULT_MODEL
        out = Path(a.out or f"out/{model_name}-{stem}")
        if main:  # the outputs are rank 0's
            outputs.check_out_dir(out, overwrite=a.overwrite)
            if a.json:
                outputs.check_file_target(Path(a.json), option="--json")
            if a.plot and importlib.util.find_spec("matplotlib") is None:
                raise UserError("--plot needs matplotlib: pip install matplotlib")
        source = inputs.model_source(a.model)  # where the model lives and in which format: resolved once
        task = tasks.resolve(a, source)  # --task, or detected from config.json (bridge.app.tasks)
        tasks.check_options(a, task)
        placement.check_run_options(a)
        driver = drivers.choose_driver(a, recipe, label, source, task=task)  # streamed or in memory, and whether it fits
    if driver.streamed:
        return streaming.cmd_streamed(a, recipe, label, out, source, t0, driver)
    phases = {"check": time.perf_counter() - t0}  # seconds of each phase (PHASES), in the report
    with launch.stage():
        model, tokenizer, device, eval_seqs, probe, calibration, plan, dtypes, stored, inventory, notes = _prepare(
            a, recipe, label, source, out, task)
    phases["load"] = time.perf_counter() - t0 - phases["check"]
    unmatched = recipe.unmatched(plan)
    for glob in unmatched:
        warn(f"recipe pattern {glob!r} matches no tensor of the model")
    parallel = current()  # the perplexities shared over the ranks too (exactly the one-process value)

    ppl_before = None
    if eval_seqs is not None:
        say(f"perplexity of the original on {eval_seqs.numel()} tokens ...")
        te = time.perf_counter()
        ppl_before = evaluate.perplexity(model, eval_seqs, progress=main, parallel=parallel).perplexity
        phases["eval before"] = time.perf_counter() - te
    if probe is not None:
        say(f"outputs of the original on {probe.samples} held-out inputs ({probe.what}) ...")
        te = time.perf_counter()
        probe.before(model)
        phases["eval before"] = time.perf_counter() - te

    say(f"quantizing with {label} ({report.steps_label(recipe.steps)}) ...")
    tq = time.perf_counter()
    try:
        with torch.no_grad():
            result = pipeline.quantize_params(model, plan, calibration=calibration, progress=outputs.progress_bar(),
                                              all_experts=a.calibrate_all_experts)
    except (TypeError, ValueError) as e:  # a step refusing the recipe's specs or options
        raise UserError(f"recipe {label}: {e}") from None
    seconds_q = phases["quantize"] = time.perf_counter() - tq
    if device is not None:  # back to the host: the quantized model is built and written there, as without --device
        model.to("cpu")
        result = placement.to_host(result, host=extract(model))
    size_before = placement.stored_size(source, result.params, stored)
    tr = time.perf_counter()
    rows = report.layer_rows(result.params, result.qtree, plan, error=a.layer_errors, dtypes=stored) if main else []
    tm = time.perf_counter()
    qmodel = to_module(model, result, inplace=True)  # as bridge.quantize does
    phases["report"], phases["modules"] = tm - tr, time.perf_counter() - tm
    facts = result._replace(params={}, qtree={})  # what the report needs once the trees are the model's
    del result

    ppl_after = None
    if eval_seqs is not None:
        say("perplexity of the quantized model ...")
        te = time.perf_counter()
        if device is not None:
            qmodel.to(device)
        ppl_after = evaluate.perplexity(qmodel, eval_seqs, progress=main, parallel=parallel).perplexity
        if device is not None:
            qmodel.to("cpu")
        phases["eval after"] = time.perf_counter() - te
    quality = {}
    if probe is not None:
        say(f"{task.name}: the quantized model against the original ...")
        te = time.perf_counter()
        quality = probe.after(qmodel)
        phases["eval after"] = time.perf_counter() - te
    if not main:  # the last collective is behind: rank 0 writes, the others are done
        return 0

    run = record.Run(model=a.model or models.DEFAULT_MODEL, label=label, recipe=recipe, out=out, driver=driver.why,
                     t0=t0, eval_seqs=eval_seqs, calibration=calibration, ppl_before=ppl_before, phases=phases,
                     notes=notes + record.carried_note(inventory.carried if inventory else ()))
    rep = run.report(facts, rows, size_before=size_before, size_after=report.tree_bytes(extract(qmodel)),
                     seconds=seconds_q, ppl_after=ppl_after, outputs=records(read_outputs(qmodel)),
                     output_bytes=output_bytes(qmodel), task=task.name, task_chosen=task.chosen, quality=quality)
    write = io.checkpoint_writer(qmodel, recipe=recipe, recipe_name=label, tokenizer=tokenizer,
                                 rules={p: plan[p].rule for p in plan.specs}, dtypes=dtypes,
                                 carried={n: inventory.read(n) for n in inventory.carried} if inventory else None)
    try:  # checkpoint, report and plot in one temporary directory, renamed to --out when all are written
        with store.atomic_directory(out, overwrite=a.overwrite) as tmp:
            tw = time.perf_counter()
            write(tmp)
            if inventory is not None:  # every stored tensor of the input is in the output, or nothing appears
                inventory.check(tmp)
            phases["write"] = time.perf_counter() - tw
            record.write_report(a, run, rep, tmp)
    except OSError as e:  # atomic_directory's WriteError names --out already
        raise UserError(str(store.write_error(e, out))) from None
    record.publish_report(a, rep, out)
    return 0
