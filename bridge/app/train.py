"""``qtransform train``: quantization-aware training end to end from the command line, a float model and a recipe
in, the trained quantized checkpoint with its report out.

The float model is loaded as ``quantize`` loads it, :func:`bridge.qat.prepare` puts trainable fake quantizers on a
copy (a recipe with steps runs them first on ``--calib N`` sequences: ``--recipe qat2-g64`` trains block by block,
Block-AP, before the end-to-end training), :mod:`.train_loop` trains it on the training corpus's token sequences
until ``--tokens`` are consumed, :func:`bridge.qat.convert` makes the quantized model of the trained ranges, and the
checkpoint, ``report.json`` (the loss of every step) and the plot are written in one atomic directory, as
``quantize`` writes them (:mod:`.record`: the one run record).

The data: the corpus's calibration part (the built-in corpus's, or a ``hf:`` dataset's train split) is the
training text, cut into ``--seq-len`` windows (the budget's worth: the first ``steps × --batch`` of them at most,
each read once when the text holds them all); the evaluation part stays held out. A text file serves both parts:
its first ``--eval-sequences`` windows are held out for the perplexities, training reads the ones after them.
``--calib N`` takes the first N training sequences.

Everything that can be checked without the weights is checked first: the numbers, the recipe (its steps and static
activation specs against ``--calib``; against the shapes of ``config.json``), ``--ranges-only`` against the
recipe's specs, the output, ``--resume`` against the state left by the interrupted run
(:class:`~bridge.app.train_state.TrainState`: refused naming each input that changed; the data once it is
tokenized, before any training).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from pathlib import Path

from . import inputs, outputs, placement
from .inputs import UserError
from .outputs import say

__all__ = ["add_parser", "cmd_train"]

#: Built-in corpora whose calibration and evaluation parts are disjoint texts.
_SPLIT = ("builtin", "hf:")


def _number(text: str, *, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if zero else '>'} 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    return _number(text, zero=False)


def _non_negative_float(text: str) -> float:
    return _number(text, zero=True)


def _token_budget(text: str) -> int:
    """``2000000``, ``2M``, ``500k``: a number of tokens, at least 1."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    try:
        value = int(float(digits) * scale) if scale > 1 else int(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens (2000000, 2M, 500k), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 token, got {text}")
    return value


def add_parser(sub, at_least):
    t = sub.add_parser("train", help="quantization-aware training end to end: a model and a recipe in, the trained "
                                     "quantized checkpoint out (docs/qat.md)")
    t.add_argument("--model", help="transformers directory or .gguf file ('default' or none: SmolLM2-135M-Instruct)")
    t.add_argument("--recipe", required=True, help="preset name or JSON/TOML file; its steps run first on --calib")
    t.add_argument("--calib", type=at_least(0), default=0, metavar="N",
                   help="sequences (the first N training ones) for the recipe's steps and static activation ranges")
    t.add_argument("--calib-batch", type=at_least(1), default=4, metavar="B", help="calibration sequences per pass")
    t.add_argument("--tokens", type=_token_budget, required=True, metavar="BUDGET",
                   help="training tokens (2000000, 2M, 500k): steps = ceil(BUDGET / (batch x seq-len))")
    t.add_argument("--corpus", default="builtin",
                   help="'builtin' (its calibration part trains, its evaluation part is held out), a text file (its "
                        "first --eval-sequences windows held out), or hf:NAME[/CONFIG] (train split; test held out)")
    t.add_argument("--seq-len", type=at_least(2), default=512, help="tokens per sequence (training and evaluation)")
    t.add_argument("--batch", type=at_least(1), default=4, metavar="B", help="sequences per step (default 4)")
    t.add_argument("--lr", type=_positive_float, default=1e-5, help="AdamW's learning rate of the weights (1e-5)")
    t.add_argument("--range-lr", type=_positive_float, default=1e-4,
                   help="the learned ranges' learning rate, in their own group without weight decay (1e-4)")
    t.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                   help="the learning rates after the warm-up: constant (default) or a cosine decay to zero")
    t.add_argument("--warmup", type=at_least(0), default=0, metavar="STEPS",
                   help="steps of linear warm-up of the learning rates (0)")
    t.add_argument("--weight-decay", type=_non_negative_float, default=0.0, help="the weights' decoupled weight decay (0)")
    t.add_argument("--ranges-only", action="store_true",
                   help="freeze every weight and train the learned ranges alone (EfficientQAT's E2E-QP)")
    t.add_argument("--distill", action="store_true",
                   help="add the KL to the float model's next-token distribution (the teacher) to the loss")
    t.add_argument("--temperature", type=_positive_float, help="the distillation's softmax temperature (1; with --distill)")
    t.add_argument("--save-every", type=at_least(1), default=100, metavar="STEPS",
                   help="save the training state every STEPS steps (and when training completes) for --resume")
    t.add_argument("--resume", action="store_true", help="continue the interrupted training of the same command")
    t.add_argument("--seed", type=at_least(0), default=0, help="the batches' shuffle and torch's generator (0)")
    t.add_argument("--out", required=True, help="output directory (must not exist, unless --overwrite)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    t.add_argument("--plot", action="store_true", help="write report.png (the loss curve too) next to the checkpoint")
    t.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    t.add_argument("--no-eval", action="store_true", help="skip the perplexity before/after")
    t.add_argument("--eval-sequences", type=at_least(1), default=8, help="number of evaluation sequences (8)")
    t.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="dtype of the checkpoint's float tensors (default auto: as stored in the input)")
    t.add_argument("--device", help="where training runs (cpu, cuda, cuda:1...; default cpu); written from the host")
    t.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: torch's)")
    return t


def _recipe(a):
    """``(recipe, label)`` of ``--recipe``, its steps and static activation specs checked against ``--calib``."""
    import qtransform as qt
    from .. import pipeline

    preset = inputs.load_recipe(a.recipe)
    try:
        qt.check_steps(preset.recipe.steps, calibrated=bool(a.calib))
        pipeline.check_calibration(preset.recipe, calibrated=bool(a.calib))
    except (TypeError, ValueError) as e:
        raise UserError(f"recipe {preset.name}: {e}") from None
    return preset.recipe, preset.name


def _check_plan(skeleton, recipe, label: str, a) -> None:
    """The recipe against the model's shapes (``config.json`` alone), and ``--ranges-only`` against its specs."""
    from qtransform import learn

    from .. import pipeline

    try:
        p = pipeline.prepare(skeleton, recipe, calibrated=bool(a.calib))
    except (TypeError, ValueError) as e:
        raise UserError(f"recipe {label}: {e}") from None
    static = [s for s in p.activations.values() if not s.dynamic]
    if a.ranges_only and not static and not any(learn.ranged(s) for s in p.specs.values()):
        raise UserError(f"--ranges-only: recipe {label} has no range to learn (its weight formats are casts, whose "
                        "scale is 1, and it has no static activation range); train the weights (without --ranges-only)")


def _identity(source) -> dict:
    """The model's files (names, sizes, modification times) and config: what a resumed run must find again."""
    d = source.directory
    names = [source.gguf_file] if source.gguf_file else sorted(
        p.name for p in d.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json", ".gguf", ".bin"))
    files = {n: [(d / n).stat().st_size, (d / n).stat().st_mtime_ns] for n in names}
    config = (d / "config.json").read_text() if source.gguf_file is None and (d / "config.json").is_file() else ""
    return {"files": files, "config": config}


def _options(a, recipe) -> dict:
    """The parts of the fingerprint known before loading (:func:`bridge.app.train_state.fingerprint`)."""
    import qtransform as qt
    import torch

    return {"recipe": recipe.to_dict(), "calib": [a.calib, a.calib_batch], "corpus": a.corpus, "tokens": a.tokens,
            "seq-len": a.seq_len, "batch": a.batch, "lr": a.lr, "range-lr": a.range_lr, "weight-decay": a.weight_decay,
            "schedule": a.schedule, "warmup": a.warmup, "ranges-only": a.ranges_only, "distill": a.distill,
            "temperature": a.temperature, "seed": a.seed,
            "device": a.device or "cpu", "versions": [qt.__version__, torch.__version__]}


def _data(a, tokenizer, model, steps: int):
    """``(train, eval_seqs, calibration, notes)``: the training sequences (the first ``steps × --batch`` windows
    at most: the budget's worth, only as much text tokenized), the held-out evaluation ones (``None`` with
    ``--no-eval``), the calibration batches (the first ``--calib`` windows; ``None`` without it) and the report's
    notes."""
    import torch

    split = a.corpus.startswith(_SPLIT)
    text = inputs.corpus_text(a.corpus, part="calibration")
    held = 0 if split else a.eval_sequences  # one text for both parts: its first windows held out, always
    windows = inputs.sequences(tokenizer, text, a.corpus, a.seq_len, held + max(steps * a.batch, a.calib))
    if windows.shape[0] <= held:
        raise UserError(f"corpus {a.corpus!r} holds {windows.shape[0]} sequences of {a.seq_len} tokens: the {held} "
                        "held out for evaluation (--eval-sequences) leave none to train on")
    train = windows[held:held + steps * a.batch]
    notes, eval_seqs = [], None
    if split and not a.no_eval:
        eval_seqs = inputs.sequences(tokenizer, inputs.corpus_text(a.corpus), a.corpus, a.seq_len, a.eval_sequences)
    elif not split:
        eval_seqs = None if a.no_eval else windows[:held]
        notes.append(f"corpus {a.corpus}: its first {held} sequences of {a.seq_len} tokens held out for evaluation, "
                     f"the {train.shape[0]} after them trained on")
    inputs.check_vocab(model, windows, "training text")
    inputs.check_vocab(model, eval_seqs, "evaluation text")
    calibration = None
    if a.calib:
        if windows.shape[0] - held < a.calib:
            raise UserError(f"corpus {a.corpus!r} holds {windows.shape[0] - held} training sequences of {a.seq_len} "
                            f"tokens, --calib asks for {a.calib}")
        calibration = list(torch.split(windows[held:held + a.calib], a.calib_batch))
    return train, eval_seqs, calibration, notes


def _settings(a, steps: int):
    from .train_loop import Settings

    return Settings(steps=steps, batch=a.batch, lr=a.lr, range_lr=a.range_lr, weight_decay=a.weight_decay,
                    ranges_only=a.ranges_only, distill=a.distill,
                    temperature=1.0 if a.temperature is None else a.temperature, seed=a.seed, save_every=a.save_every,
                    schedule=a.schedule, warmup=a.warmup)


def _door(a):
    """Everything checked before the weights load: ``(recipe, label, out, source, state, fp)``."""
    from .train_state import TrainState, fingerprint

    if a.temperature is not None and not a.distill:
        raise UserError("--temperature goes with --distill (the distillation's temperature)")
    if a.ranges_only and a.weight_decay:
        raise UserError("--weight-decay: --ranges-only freezes every weight (the ranges never get weight decay)")
    steps = math.ceil(a.tokens / (a.batch * a.seq_len))
    if a.warmup >= steps:
        raise UserError(f"--warmup: {a.warmup} steps leave none of the {steps} that --tokens {a.tokens} gives "
                        f"(--batch {a.batch} x --seq-len {a.seq_len} tokens a step)")
    recipe, label = _recipe(a)
    out = Path(a.out)
    outputs.check_out_dir(out, overwrite=a.overwrite)
    if a.json:
        outputs.check_file_target(Path(a.json), option="--json")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--plot needs matplotlib: pip install matplotlib")
    placement.check_device(a)
    model_arg = None if a.model in (None, "default") else a.model
    source = inputs.model_source(model_arg)
    state = TrainState(out)
    fp = fingerprint(model=_identity(source), **_options(a, recipe))
    if a.resume:
        try:
            state.check(fp)
        except ValueError as e:
            raise UserError(str(e)) from None
    skeleton = inputs.skeleton(source)
    if skeleton is not None:
        _check_plan(skeleton, recipe, label, a)
        inputs.check_seq_len(skeleton, a.seq_len)
    return recipe, label, out, source, state, fp


def cmd_train(a) -> int:
    import torch

    from .. import io, qat
    from ..checkpoint import store
    from ..modules.online import online_rotations
    from ..stream.workdir import calibration_digest
    from ..tree import Quantized, extract
    from . import evaluate, models, record, report
    from .train_loop import nothing_to_train, train
    from .train_report import moved, training_record
    from .train_state import fingerprint

    t0 = time.perf_counter()
    recipe, label, out, source, state, fp = _door(a)
    model_arg = None if a.model in (None, "default") else a.model
    phases = {"check": time.perf_counter() - t0}
    say(f"loading {model_arg or models.DEFAULT_MODEL} ...")
    model, tokenizer = inputs.model_and_tokenizer(model_arg, source=source, dequantize_imported=True)
    inputs.check_seq_len(model, a.seq_len)
    steps = math.ceil(a.tokens / (a.batch * a.seq_len))
    train_seqs, eval_seqs, calibration, notes = _data(a, tokenizer, model, steps)
    fp = {**fp, **fingerprint(data=calibration_digest([train_seqs, *(calibration or [])]))}
    snapshot = None
    try:
        if a.resume:
            state.check(fp)  # the data too, before any work
            snapshot = state.load()
    except ValueError as e:
        raise UserError(str(e)) from None
    device = torch.device(a.device) if a.device else None
    if device is not None:
        model.to(device)
    phases["load"] = time.perf_counter() - t0 - phases["check"]

    say(f"preparing {label} ({report.steps_label(recipe.steps)}"
        + (f", on {sum(int(b.numel()) for b in calibration)} calibration tokens" if calibration else "") + ") ...")
    tp = time.perf_counter()
    try:
        fake = qat.prepare(model, recipe, calibration=calibration)
    except (TypeError, ValueError) as e:
        raise UserError(f"recipe {label}: {e}") from None
    settings = _settings(a, steps)
    why = nothing_to_train(fake, settings)  # a GGUF file's recipe, which config.json could not check ahead
    if why:
        raise UserError(why)
    model.requires_grad_(False)  # the float model: the teacher, and the report's "before"
    phases["prepare"] = time.perf_counter() - tp

    ppl_before = None
    if eval_seqs is not None:
        say(f"perplexity of the float model on {eval_seqs.numel()} tokens ...")
        te = time.perf_counter()
        ppl_before = evaluate.perplexity(model, eval_seqs, progress=True).perplexity
        phases["eval before"] = time.perf_counter() - te
    where = f"resuming at step {snapshot.step} of {steps}" if snapshot is not None else f"{steps} steps"
    say(f"training end to end: {where}, {a.batch} x {a.seq_len} tokens a step, on {train_seqs.shape[0]} sequences ...")
    if snapshot is None:
        state.start()
    try:
        trained = train(fake, train_seqs, settings, teacher=model if a.distill else None, state=state, fp=fp,
                        snapshot=snapshot, progress=outputs.progress_bar())
    except ValueError as e:
        raise UserError(str(e)) from None
    del snapshot  # its tensors are the model's and the optimizer's now
    phases["train"] = trained.seconds

    tc = time.perf_counter()
    if device is not None:  # the quantized model is built and written on the host, as without --device
        fake.to("cpu")
        model.to("cpu")
    plan = qat.prepared_plan(fake)
    activations = qat.learned_qparams(fake)[1]
    params = extract(model)
    info = moved(fake, params, plan)
    qmodel = qat.convert(fake, inplace=True)
    del fake
    phases["convert"] = time.perf_counter() - tc
    ppl_after = None
    if eval_seqs is not None:
        say("perplexity of the trained quantized model ...")
        te = time.perf_counter()
        if device is not None:
            qmodel.to(device)
        ppl_after = evaluate.perplexity(qmodel, eval_seqs, progress=True).perplexity
        if device is not None:
            qmodel.to("cpu")
        phases["eval after"] = time.perf_counter() - te

    dtypes = placement.stored_dtypes(a, source, model)
    stored = dtypes if a.dtype == "auto" else placement.stored_dtypes(a, source, model, dtype="auto")
    qtree = extract(qmodel)
    rows = report.layer_rows(params, qtree, plan, dtypes=stored)
    facts = Quantized({}, {}, plan, activations, info, online_rotations(qmodel))
    run = record.Run(model=model_arg or models.DEFAULT_MODEL, label=label, recipe=recipe, out=out,
                     driver="in memory (qtransform train trains the whole model)", t0=t0, eval_seqs=eval_seqs,
                     calibration=calibration, ppl_before=ppl_before, phases=phases, notes=notes)
    rep = run.report(facts, rows, size_before=placement.stored_size(source, params, stored),
                     size_after=report.tree_bytes(qtree), seconds=trained.seconds, ppl_after=ppl_after,
                     training=training_record(settings, trained, sequences=train_seqs, budget=a.tokens))
    write = io.checkpoint_writer(qmodel, recipe=recipe, recipe_name=label, tokenizer=tokenizer,
                                 rules={p: plan[p].rule for p in plan.specs}, dtypes=dtypes)
    try:  # checkpoint, report and plot in one temporary directory, renamed to --out when all are written
        with store.atomic_directory(out, overwrite=a.overwrite) as tmp:
            tw = time.perf_counter()
            write(tmp)
            phases["write"] = time.perf_counter() - tw
            record.write_report(a, run, rep, tmp)
    except OSError as e:
        raise UserError(str(store.write_error(e, out))) from None
    state.remove()  # the output is whole: nothing left to resume
    record.publish_report(a, rep, out)
    return 0
