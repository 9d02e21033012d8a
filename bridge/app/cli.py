"""The ``qtransform`` command.

    qtransform quantize [--model PATH] [--task TASK] [--recipe NAME|FILE] [--algorithm NAME] [--lowrank RANK] [--calib N [--calib-batch B]]
                        [--out DIR [--overwrite]] [--plot] [--json FILE] [--no-eval] [--dtype auto|float32|...]
                        [--device DEV] [--stream | --in-memory] [--resume] [--max-memory SIZE]
                        [--no-memory-check] [--no-layer-errors]   (bridge.app.driver, bridge.app.placement)
                        [--nproc N] [--dist-timeout SECONDS]   (bridge.app.ranks, docs/distributed.md)
    qtransform eval --model DIR [--baseline PATH] [--tasks NAME[,NAME] [--include-path DIR] [--limit N]]
                                                                            (bridge.app.lmeval: lm-eval-harness)
    qtransform formats | recipes | inspect DIR
    qtransform export CHECKPOINT --to quark|compressed-tensors|gguf|onnx --out DIR   (bridge.app.export)
    qtransform search --budget BITS [--candidates ...] [--calib N] [--pin GLOB=SCHEME] [--to TARGET] --out FILE
                                                                            (bridge.app.search)
    qtransform train [--model PATH|default] --recipe NAME|FILE [--calib N] --tokens BUDGET [--corpus builtin|FILE]
                     [--seq-len L] [--batch B] [--lr LR] [--range-lr LR] [--ranges-only] [--distill [--temperature T]]
                     [--save-every STEPS] [--resume] --out DIR [--plot] [--no-eval] [--threads N] [--seed S]
                                                                            (bridge.app.train, docs/qat.md)

This module parses the command line and dispatches; each subcommand that does more than print a
listing has its module (``quantize``: :mod:`bridge.app.quantize`, ``export``: :mod:`bridge.app.export`, ``train``:
:mod:`bridge.app.train`).

``--plugin FILE.py|MODULE`` (any command, repeatable) imports Python code first: formats,
observers, algorithms or presets it registers are then usable by name (in recipe files too).

User mistakes (a missing model, a bad recipe file, an existing output directory, an
unreadable corpus, a damaged checkpoint, a full disk...) print one line on stderr and exit with
status 1 (2 for bad arguments); so does any other error (its type named), never a traceback, and
transformers' log (its multi-line load reports) is silenced while a command runs. Whatever can be checked without the weights (the recipe against the
shapes of ``config.json``, where the outputs go, the numbers) is checked before the model
loads. Nothing is written half-way: the checkpoint, ``report.json`` and the plot are
assembled in the library's atomic directory (:func:`bridge.checkpoint.store.atomic_directory`),
renamed at the end; ``--json`` files are written under a temporary name. When the reader of
stdout goes away (``| head``) the command stops quietly with status 141.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

from . import export, inputs, lmeval, outputs, placement, ranks, search, tasks, train
from ..distributed import launch
from .inputs import UserError
from .outputs import say as _say
from .quantize import cmd_quantize

__all__ = ["main"]

DEFAULT_RECIPE = "hqq4-g64"
DEFAULT_PROMPT = "The three most useful Python built-in functions are"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _at_least(low: int):
    """An argparse type: an integer >= ``low`` (checked when the line is parsed, before any work)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


# ------------------------------------------------------------------ eval
def cmd_eval(a) -> int:
    from . import evaluate

    if a.tasks is not None:  # lm-evaluation-harness instead of the perplexity
        return lmeval.cmd_eval_tasks(a)
    targets = [("model", a.model)] + ([("baseline", a.baseline)] if a.baseline else [])
    if a.json:
        outputs.check_file_target(Path(a.json), option="--json")
    sources = [inputs.model_source(None if path == "default" else path) for _, path in targets]
    results = []
    seqs = None
    text = inputs.corpus_text(a.corpus)
    for (role, path), source in zip(targets, sources):
        _say(f"loading {role} {path} ...")
        model, tokenizer = inputs.model_and_tokenizer(None if path == "default" else path, source=source)
        if seqs is None:
            seqs = inputs.sequences(tokenizer, text, a.corpus, a.seq_len, a.eval_sequences)
        inputs.check_seq_len(model, a.seq_len)
        inputs.check_vocab(model, seqs, "evaluation text")
        ppl = evaluate.perplexity(model, seqs, progress=True).perplexity
        generation = evaluate.generate(model, tokenizer, a.prompt, max_new_tokens=a.max_new_tokens)
        results.append({"role": role, "model": path, "perplexity": ppl, "generation": generation})
        del model
    rows = [["", *(r["role"] for r in results)],
            ["path", *(r["model"] for r in results)],
            [f"perplexity ({seqs.numel()} tokens)", *(f"{r['perplexity']:.3f}" for r in results)]]
    from .report import table
    _say()
    _say("\n".join(table(rows)))
    _say(f"\nprompt: {a.prompt!r}")
    for r in results:
        _say(f"[{r['role']}] {r['generation'].strip()}")
    if a.json:
        outputs.write_text(Path(a.json), json.dumps({"tokens": int(seqs.numel()), "results": results}, indent=2) + "\n",
                           option="--json")
    return 0


# ------------------------------------------------------------------ formats / recipes / inspect
def cmd_formats(a) -> int:
    import qtransform as qt
    from .report import table

    rows = [["format", "family", "bits/element", "default granularity", "round-trip bound"]]
    for name, fmt in qt.FORMATS.items():
        try:
            spec = qt.QuantSpec(format=name)
        except ValueError:  # int1 holds no symmetric range
            spec = qt.QuantSpec(format=name, symmetric=False)
        bits = qt.bits_per_element(spec)
        rows.append([name, fmt.family, f"{bits:g}", str(spec).split(" ", 1)[1], fmt.codec.bound])
    _say("\n".join(table(rows)))
    return 0


def cmd_recipes(a) -> int:
    import qtransform as qt
    from .report import steps_label, table

    rows = [["recipe", "steps", "linear layers get", "description"]]
    for name, p in qt.presets().items():
        rows.append([name, steps_label(p.steps), str(p.spec), p.description])
    _say("\n".join(table(rows)))
    steps = [["step", "options (name: type = default)"]] + [  # from each algorithm's options dataclass
        [n, ", ".join(f"{o}: {t} = {d!r}" for o, t, d in a.option_fields())] for n, a in sorted(qt.ALGORITHMS.items())]
    _say("\n" + "\n".join(table(steps)))
    _say("\nA recipe file (JSON or TOML) has keys steps, default, rules, type_rules, exclude, min_ndim, or an "
         "HQQ-style nbits/group_size/dynamic_config; specs are QuantSpec dicts or preset names; steps are "
         "algorithm names or tables {name = ..., <option> = ...}.")
    return 0


def cmd_inspect(a) -> int:
    from . import describe

    try:
        text = describe.describe(Path(a.directory))
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from None
    _say(text)
    return 0


# ------------------------------------------------------------------ entry point
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qtransform", description="Quantize, evaluate and inspect models with qtransform.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    q = sub.add_parser("quantize", help="quantize a transformers model (causal LM, encoder, image classifier: --task) "
                                        "and save a checkpoint")
    q.add_argument("--model", help="transformers directory or .gguf file (default: SmolLM2-135M-Instruct)")
    q.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"preset name or JSON/TOML file (default {DEFAULT_RECIPE})")
    q.add_argument("--algorithm", help="run this one algorithm instead of the recipe's steps (rtn, hqq, ...)")
    q.add_argument("--calib", type=_at_least(0), default=0, metavar="N",
                   help="calibration sequences (of --seq-len tokens) from the corpus's calibration part, for steps "
                        "that need data")
    q.add_argument("--kv-cache", metavar="FORMAT[:head]",
                   help="also quantize the key/value cache in FORMAT (fp8_e4m3, int8...), static per-tensor scales "
                        "(FORMAT:head: one per key/value head) calibrated from data (needs --calib)")
    q.add_argument("--lowrank", type=_at_least(1), metavar="RANK",
                   help="after the recipe's steps, a rank-RANK correction of each quantized linear's error (EoRA: "
                        "weighted by its input Hessian with --calib, the plain SVD without)")
    q.add_argument("--calib-batch", type=_at_least(1), default=4, metavar="B", help="calibration sequences per forward pass")
    q.add_argument("--calib-images", metavar="DIR|FILE.jsonl|synthetic",
                   help="image classifiers: calibrate on N images of DIR (or synthetic); vision-language models: "
                        "calibrate on N image-text pairs made by the model's processor: the "
                        "images of DIR (captions in same-name .txt files), a JSONL of {image, text}, or synthetic "
                        "images (the default for a model with a vision tower and a processor)")
    q.add_argument("--calibrate-all-experts", action="store_true",
                   help="mixture-of-experts models: every expert's statistics see every calibration token (the layer's "
                        "output stays the routed one); default: the tokens routed to it")
    q.add_argument("--out", help="output directory (default out/<model>-<recipe>)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    q.add_argument("--plot", action="store_true", help="write report.png next to the checkpoint")
    q.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    q.add_argument("--no-eval", action="store_true", help="skip the perplexity before/after")
    placement.add_options(q)
    tasks.add_options(q)
    export.add_quantize_options(q)
    ranks.add_options(q, _at_least)

    e = sub.add_parser("eval", help="perplexity and a greedy generation (or lm-evaluation-harness tasks with --tasks), "
                                    "optionally against a baseline")
    e.add_argument("--model", required=True, help="checkpoint or model directory (or 'default')")
    e.add_argument("--baseline", help="model to compare with (a path, or 'default' for SmolLM2-135M)")
    e.add_argument("--prompt", default=DEFAULT_PROMPT)
    e.add_argument("--max-new-tokens", type=_at_least(1), default=32)
    e.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    lmeval.add_options(e, _at_least)

    for cmd in (q, e):
        cmd.add_argument("--threads", type=_at_least(1), default=None,
                         help="torch CPU threads (default: torch's; 1 is fastest on a busy machine)")
        cmd.add_argument("--corpus", default="builtin",
                         help="'builtin' (Python's docstrings), a text file, or hf:NAME[/CONFIG] (a Hugging Face dataset)")
        cmd.add_argument("--seq-len", type=_at_least(2), default=512, help="tokens per evaluation sequence")
        cmd.add_argument("--eval-sequences", type=_at_least(1), default=8, help="number of evaluation sequences")

    f = sub.add_parser("formats", help="every registered format with its bits per element and error bound")
    r = sub.add_parser("recipes", help="the named recipe presets")
    i = sub.add_parser("inspect", help="what a checkpoint holds")
    i.add_argument("directory")
    for cmd in (q, e, f, r, i, export.add_parser(sub), search.add_parser(sub, _at_least), train.add_parser(sub, _at_least)):
        cmd.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE",
                         help="import this first (it may register formats, observers, algorithms, presets)")
    return p


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval, "formats": cmd_formats, "recipes": cmd_recipes,
            "inspect": cmd_inspect, "export": export.cmd_export, "search": search.cmd_search,
            "train": train.cmd_train}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    if getattr(args, "threads", None) is not None:
        import torch
        torch.set_num_threads(args.threads)
    where = ""  # "rank R: " under torchrun with several ranks (bridge.app.ranks)
    try:
        inputs.load_plugins(args.plugin)
        if getattr(args, "nproc", None) is not None:
            status = ranks.relaunch(args, argv)
            if status is not None:
                return status
        with ranks.group(args):
            where = launch.where()
            with _quiet_transformers(args.command in QUIET):
                return COMMANDS[args.command](args)
    except (UserError, launch.RankFailed) as e:
        print(f"qtransform: error: {where}{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"qtransform: {where}interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`qtransform inspect DIR | head -1`): stop quietly, as cat does
        _silence_stdout()
        return 141  # 128 + SIGPIPE, the status a shell reports for a writer killed by a closed pipe
    except (OSError, ValueError) as e:  # a message of ours or the OS's (it names the path): as it is
        print(f"qtransform: error: {where}{_first_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001  (any other library's error: one line with its type, no traceback)
        lost = ranks.error_text(e) if where else None  # a collective whose peer is gone
        print(f"qtransform: error: {where}{lost or f'{type(e).__name__}: {_first_line(e)}'}", file=sys.stderr)
        return 1


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


#: Commands that load models: transformers' log (its multi-line load reports) is silenced while they run.
QUIET = ("quantize", "eval", "inspect", "export", "search", "train")


@contextlib.contextmanager
def _quiet_transformers(quiet: bool):
    """transformers' logging at ERROR (no load reports, no advice) while the command runs, restored after."""
    if not quiet:
        yield
        return
    try:
        from transformers.utils import logging as tf_logging
    except ImportError:  # transformers is a dependency; without it the command reports what is missing
        yield
        return
    before = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(before)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured output)
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
