"""``qtransform quantize`` streamed (the default for a checkpoint directory, :mod:`bridge.app.driver`): a
checkpoint quantized shard to shard or block by block (:func:`bridge.stream.quantize_checkpoint`), never whole in
memory; and ``--dtype``, the dtype the float tensors of every quantized checkpoint are stored in (default: as in
the input).

``--resume`` continues a streamed run that was interrupted (same command, same inputs: anything else is
refused, naming what changed); ``--device`` runs the block being calibrated there (in memory: the whole model,
see :mod:`bridge.app.quantize`); ``--max-memory`` bounds the
calibration activations kept in memory (beyond, they go to disk). The perplexity after is measured on the
quantized checkpoint written; the original's by loading the float model whole (in float32, as in memory) when
:func:`bridge.app.driver.choose_driver` found that it fits the memory available, else the report says it was not
measured (``qtransform eval --model DIR`` measures it elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from . import export, inputs, outputs
from .inputs import UserError
from .outputs import say, warn

__all__ = ["add_options", "check_options", "run_device", "to_host", "dtype_of", "stored_dtypes", "stored_size",
           "source_refusal", "cmd_streamed"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_options(q) -> None:
    how = q.add_mutually_exclusive_group()
    how.add_argument("--stream", action="store_true",
                     help="insist on quantizing shard to shard (steps without data) or block by block (calibrated "
                          "steps), never holding the whole model: the default for a checkpoint directory of "
                          "safetensors shards; with --stream a run that cannot stream is an error")
    how.add_argument("--in-memory", action="store_true",
                     help="load the whole model and quantize it in memory (the default for a GGUF file, another "
                          "tool's checkpoint and what streaming refuses)")
    q.add_argument("--resume", action="store_true", help="continue an interrupted streamed run of the same command")
    q.add_argument("--device", help="where the quantization runs (cpu, cuda, cuda:1...; default cpu): in memory the whole "
                                    "model is moved there from the host for the steps and the perplexities, and the "
                                    "checkpoint is written from the host as on the CPU (the same format; values "
                                    "equal to a CPU run's but at rounding near-ties); streamed only the block "
                                    "being calibrated is there")
    q.add_argument("--max-memory", metavar="SIZE",
                   help="streamed: calibration activations kept in memory (e.g. 4GB); beyond, they spill to disk")
    q.add_argument("--no-memory-check", action="store_true",
                   help="run even when the estimated peak memory exceeds what the machine has available")
    q.add_argument("--layer-errors", action=argparse.BooleanOptionalAction, default=True,
                   help="measure each quantized tensor's relative error for the report (default; it costs about as "
                        "much as round-to-nearest itself: --no-layer-errors skips it)")
    q.add_argument("--dtype", choices=_DTYPES, default="auto",
                   help="dtype of the checkpoint's float tensors (default auto: as stored in the input)")


def check_options(a) -> None:
    """The device and memory options are well formed (before anything is loaded; which driver takes
    ``--resume`` and ``--max-memory`` is :func:`bridge.app.driver.choose_driver`'s)."""
    from ..checkpoint.store import parse_size

    if a.device:
        import torch

        try:
            dev = torch.device(a.device)
        except (RuntimeError, ValueError):
            raise UserError(f"--device {a.device!r} is not a device (cpu, cuda, cuda:1...)") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {a.device}: no CUDA device is available here")
    if a.max_memory:
        try:
            parse_size(a.max_memory)
        except (TypeError, ValueError) as e:
            raise UserError(f"--max-memory {a.max_memory!r}: {e}") from None


def run_device(a):
    """The ``torch.device`` of ``--device`` for the in-memory run, ``None`` without it (``cpu``: the same moves,
    none of which copies anything)."""
    if not a.device:
        return None
    import torch

    return torch.device(a.device)


def to_host(result, host=None):
    """``result`` (a :class:`bridge.tree.Quantized`) with every tensor on the host: each tensor moved once, so
    that a leaf of ``qtree`` that is a tensor of ``params`` stays that very tensor (``Quantized.changed``).
    ``host``: ``{path: tensor}`` already on the host for the tensors of ``result.params`` (the model moved back,
    ``bridge.extract(model)``): used instead of a second copy of the float model."""
    import torch
    import torch.utils._pytree as pytree

    moved: dict[int, torch.Tensor] = {}
    for p, t in (result.params or {}).items():
        h = (host or {}).get(p)
        if isinstance(t, torch.Tensor) and isinstance(h, torch.Tensor) and h.device.type == "cpu" and (
                h.shape, h.dtype) == (t.shape, t.dtype):
            moved[id(t)] = h

    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in moved:
            moved[id(t)] = t if t.device.type == "cpu" else t.detach().to("cpu")
        return moved[id(t)]

    # ``result`` keeps every tensor alive meanwhile: an id is never reused within the call
    return result._replace(**{f: pytree.tree_map(move, getattr(result, f))
                              for f in ("params", "qtree", "activations", "online")})


def dtype_of(a):
    import torch

    return "auto" if a.dtype == "auto" else getattr(torch, a.dtype)


def stored_dtypes(a, source, model, dtype=None):
    """``save(dtypes=...)`` of the in-memory run: the float tensors as stored in a safetensors input (``auto``),
    ``--dtype`` for all, or as loaded (``auto`` for a GGUF file or another tool's checkpoint); ``dtype``
    instead of ``--dtype`` when given (``"auto"``: as stored, the report's "before")."""
    dtype = dtype_of(a) if dtype is None else dtype
    if source_refusal(source) is not None:  # loaded by transformers or an importer: float tensors as loaded
        return None if dtype == "auto" else dtype
    from ..stream.driver import stored_dtypes_of
    from ..stream.source import Source

    return stored_dtypes_of(Source(source.directory), model, dtype)


def stored_size(source, params, dtypes) -> int:
    """The model's size as the input stores it (the report's "before"): its float tensors in their stored
    ``dtypes``; a GGUF file's own size; as loaded for another tool's checkpoint."""
    from .report import tree_bytes

    if source.gguf_file is not None and (source.directory / source.gguf_file).is_file():
        return (source.directory / source.gguf_file).stat().st_size
    return tree_bytes(params, dtypes)


def source_refusal(source) -> str | None:
    """Why ``source`` (a :class:`~bridge.app.models.ModelSource`) is not a float safetensors checkpoint directory,
    which a streamed run reads whatever the recipe (``None``: it is one)."""
    if source.gguf_file is not None:
        return f"{source.gguf_file} is a GGUF file (streaming reads a directory of safetensors shards)"
    if source.imported is not None:
        return f"it is a {source.imported} checkpoint (its values are dequantized first)"
    d = source.directory
    if not ((d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()):
        return "it holds no safetensors shards"
    return None


def cmd_streamed(a, recipe, label: str, out: Path, source, t0: float, driver) -> int:
    from ..checkpoint import CheckpointError, store
    from ..distributed import current
    from ..stream import quantize_checkpoint
    from ..stream.driver import stored_dtypes_of
    from ..stream.sizing import format_size
    from . import evaluate, models, report

    name = a.model or models.DEFAULT_MODEL
    skeleton, plan = driver.prepared.model, driver.prepared.plan
    export.check_plan(a, plan, out)  # the --to target holds every spec, before anything is written
    for glob in recipe.unmatched(plan):
        warn(f"recipe pattern {glob!r} matches no tensor of the model")
    text = None if a.no_eval else inputs.corpus_text(a.corpus)
    calib_text = inputs.corpus_text(a.corpus, part="calibration") if a.calib else None
    if not a.no_eval or a.calib:
        inputs.check_seq_len(skeleton, a.seq_len)
    tokenizer = models.load_tokenizer(source)
    calibration = inputs.calibration(a, tokenizer, calib_text)
    eval_seqs = None if text is None else inputs.sequences(tokenizer, text, a.corpus, a.seq_len, a.eval_sequences)
    inputs.check_vocab(skeleton, eval_seqs, "evaluation text")
    inputs.check_vocab(skeleton, calibration, "calibration text")
    rows, rep, notes = [], {}, []
    stored = stored_dtypes_of(driver.prepared.src, skeleton)  # the bytes before of each row: the headers read once
    ppl_before = _original_perplexity(source, eval_seqs, driver, notes, parallel=current())

    def on_tensor(path, w, q):
        rows.append(report.layer_row(path, w, q, "", error=a.layer_errors, stored=stored.get(path)))

    def before_publish(tmp: Path, result) -> None:
        ppl = None
        if eval_seqs is not None and not driver.eval_after:
            notes.append(f"perplexity of the quantized checkpoint not measured: loading it whole does not fit the "
                         f"{format_size(driver.available)} available (`qtransform eval --model {out}` measures it "
                         "elsewhere)")
        elif eval_seqs is not None:
            say("perplexity of the quantized checkpoint ...")
            ppl = evaluate.perplexity(models.load_causal_lm(tmp), eval_seqs, progress=True).perplexity
        layers = [dataclasses.replace(row, rule=result.plan[row.path].rule) for row in rows]
        r = report.Report(model=name, recipe=label, steps=[s.to_dict() for s in recipe.steps], layers=layers,
                          size_before=result.bytes_in, size_after=result.bytes_out, seconds_quantize=result.seconds,
                          ppl_before=ppl_before, ppl_after=ppl, eval_tokens=0 if eval_seqs is None else int(eval_seqs.numel()),
                          calib_tokens=0 if calibration is None else sum(int(b.numel()) for b in calibration),
                          out=str(out), unmatched=recipe.unmatched(result.plan),
                          activations=report.activation_rows(result.activations), step_info=result.info,
                          online=report.online_rows(result.online), streamed=result.mode, driver=driver.why,
                          notes=notes)
        r.seconds_total = time.perf_counter() - t0
        r.peak_memory = report.peak_memory()
        (tmp / "report.json").write_text(json.dumps(r.to_dict(), indent=2) + "\n")
        if a.plot:
            r.plot(tmp / "report.png")
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
    r = rep["report"]
    if a.json:
        outputs.write_text(Path(a.json), json.dumps(r.to_dict(), indent=2) + "\n", option="--json")
    exported = export.export_after_quantize(a, out)
    say()
    say(r.render() + (f"\nresumed after {done.resumed} finished units" if done.resumed else "")
        + (f"\nexported ({a.to}): {exported}" if exported else ""))
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
