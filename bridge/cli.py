"""The ``qtransform`` command.

    qtransform quantize [--model PATH] [--recipe NAME|FILE] [--out DIR] [--plot] [--json FILE]
    qtransform eval --model DIR [--baseline PATH]
    qtransform formats | recipes | inspect DIR

User mistakes (a missing model, a bad recipe file, an existing output directory, an
unreadable corpus...) print one line on stderr and exit with status 1 (2 for bad
arguments); nothing is written half-way: the checkpoint, ``report.json`` and the plot
are assembled in a temporary directory that is renamed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

__all__ = ["main"]

DEFAULT_RECIPE = "hqq4-g64"
DEFAULT_PROMPT = "The three most useful Python built-in functions are"


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _warn(msg: str) -> None:
    print(f"qtransform: warning: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ recipes
def _load_recipe(name_or_file: str):
    """A :class:`qtransform.Preset` (recipe, algorithm, options; its name is the label) from a
    preset name or a JSON/TOML recipe file."""
    import qtransform as qt

    path = Path(name_or_file)
    if path.suffix.lower() in (".json", ".toml") or path.exists():
        if not path.is_file():
            raise UserError(f"recipe file not found: {path}")
        try:
            text = path.read_text()
            if path.suffix.lower() == ".toml":
                try:
                    import tomllib
                except ImportError:  # Python 3.10
                    import tomli as tomllib
                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read recipe file {path}: {e}") from None
        try:
            return qt.recipe_from_dict(data, name=str(path))
        except (TypeError, ValueError) as e:
            raise UserError(f"recipe file {path}: {e}") from None
    try:
        return qt.get_preset(name_or_file)
    except ValueError as e:
        raise UserError(str(e)) from None


# ------------------------------------------------------------------ corpus
def _corpus_text(source: str) -> str:
    from . import corpus

    try:
        return corpus.load_text(source, part="eval")
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"cannot read corpus {source!r}: {e}") from None


def _sequences(tokenizer, text: str, source: str, seq_len: int, count: int):
    from . import corpus

    try:
        return corpus.token_sequences(text, tokenizer, seq_len=seq_len, max_sequences=count)
    except corpus.CorpusError as e:
        raise UserError(f"corpus {source!r}: {e}") from None


def _load(model_arg):
    from . import models

    try:
        return models.load(model_arg)
    except (FileNotFoundError, ImportError, OSError, ValueError) as e:
        raise UserError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


# ------------------------------------------------------------------ quantize
def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"output directory {out} exists and is not empty (pass --overwrite to replace it)")


def _progress(desc: str):
    """A ``progress(iterable, total=...)`` wrapper with a tqdm bar on stderr."""
    from tqdm.auto import tqdm

    return lambda it, total=None: tqdm(it, total=total, desc=desc, unit="tensor", file=sys.stderr,
                                       leave=False, dynamic_ncols=True)


def cmd_quantize(a) -> int:
    import torch

    import qtransform as qt
    from qtransform.algorithms import get_algorithm
    from . import evaluate, io, models, report, rebuild
    from .extract import extract, module_types

    t0 = time.perf_counter()
    preset = _load_recipe(a.recipe)
    recipe, algorithm, options, label = preset.recipe, preset.algorithm, preset.options, preset.name
    if a.algorithm and a.algorithm != algorithm:  # the recipe's options belong to its own algorithm
        algorithm, options = a.algorithm, {}
    try:
        algo = get_algorithm(algorithm)
    except ValueError as e:
        raise UserError(str(e)) from None
    model_name = Path(a.model).stem if a.model else models.DEFAULT_MODEL
    out = Path(a.out or f"out/{model_name}-{Path(label).stem}")
    _check_out(out, a.overwrite)
    if a.model is not None and not Path(a.model).exists():
        raise UserError(f"model not found: {a.model}")
    text = None if a.no_eval else _corpus_text(a.corpus)
    _say(f"loading {a.model or models.DEFAULT_MODEL} ...")
    model, tokenizer = _load(a.model)
    eval_seqs = None if a.no_eval else _sequences(tokenizer, text, a.corpus, a.seq_len, a.eval_sequences)

    params = extract(model)
    types = module_types(model)
    plan = recipe.plan(params, types=types)
    unmatched = recipe.unmatched(params)
    for glob in unmatched:
        _warn(f"recipe pattern {glob!r} matches no tensor of the model")
    if not any(m.spec is not None for m in plan.values()):
        raise UserError(f"recipe {label} selects no tensor of this model")
    size_before = report.tree_bytes(params)

    ppl_before = None
    if eval_seqs is not None:
        _say(f"perplexity of the original on {eval_seqs.numel()} tokens ...")
        ppl_before = evaluate.perplexity(model, eval_seqs, progress=True).perplexity

    _say(f"quantizing with {label} ({report.algorithm_label(algorithm, options)}) ...")
    tq = time.perf_counter()
    with torch.no_grad():
        qps = algo(params, recipe, types=types, progress=_progress(algorithm), **options)
        qtree = qt.quantize_tree(params, recipe, qparams=qps, types=types)
    seconds_q = time.perf_counter() - tq
    rows = report.layer_rows(params, qtree, plan)
    qmodel = rebuild.to_module(model, qtree, inplace=True)
    del params, qps

    ppl_after = None
    if eval_seqs is not None:
        _say("perplexity of the quantized model ...")
        ppl_after = evaluate.perplexity(qmodel, eval_seqs, progress=True).perplexity

    rep = report.Report(model=a.model or models.DEFAULT_MODEL, recipe=label, algorithm=algorithm,
                        algorithm_options=dict(options), layers=rows,
                        size_before=size_before, size_after=report.tree_bytes(qtree), seconds_quantize=seconds_q,
                        ppl_before=ppl_before, ppl_after=ppl_after,
                        eval_tokens=0 if eval_seqs is None else int(eval_seqs.numel()),
                        out=str(out), unmatched=unmatched)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        io.save(qmodel, tmp, recipe=recipe, tokenizer=tokenizer,
                info={"algorithm": algorithm, "algorithm_options": dict(options), "recipe_name": label,
                      "rules": {p: m.rule for p, m in plan.items() if m.spec is not None}})
        rep.seconds_total = time.perf_counter() - t0
        (tmp / "report.json").write_text(json.dumps(rep.to_dict(), indent=2) + "\n")
        if a.plot:
            rep.plot(tmp / "report.png")
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rep.to_dict(), indent=2) + "\n")
    _say()
    _say(rep.render())
    return 0


# ------------------------------------------------------------------ eval
def cmd_eval(a) -> int:
    from . import evaluate

    targets = [("model", a.model)] + ([("baseline", a.baseline)] if a.baseline else [])
    for _, path in targets:
        if path != "default" and not Path(path).exists():
            raise UserError(f"model not found: {path}")
    results = []
    seqs = None
    text = _corpus_text(a.corpus)
    for role, path in targets:
        _say(f"loading {role} {path} ...")
        model, tokenizer = _load(None if path == "default" else path)
        if seqs is None:
            seqs = _sequences(tokenizer, text, a.corpus, a.seq_len, a.eval_sequences)
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
        Path(a.json).write_text(json.dumps({"tokens": int(seqs.numel()), "results": results}, indent=2) + "\n")
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
    from .report import table, algorithm_label

    rows = [["recipe", "algorithm", "linear layers get", "description"]]
    for name, p in qt.presets().items():
        rows.append([name, algorithm_label(p.algorithm, p.options), str(p.recipe.type_rules[0][1]),
                     p.description])
    _say("\n".join(table(rows)))
    _say("\nA recipe file (JSON or TOML) has keys algorithm, options, default, rules, type_rules, exclude, or an "
         "HQQ-style nbits/group_size/dynamic_config; specs are QuantSpec dicts or preset names.")
    return 0


def cmd_inspect(a) -> int:
    from . import describe

    try:
        _say(describe.describe(Path(a.directory)))
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from None
    return 0


# ------------------------------------------------------------------ entry point
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qtransform", description="Quantize, evaluate and inspect models with qtransform.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    q = sub.add_parser("quantize", help="quantize a transformers model and save a checkpoint")
    q.add_argument("--model", help="transformers directory or .gguf file (default: SmolLM2-135M-Instruct)")
    q.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"preset name or JSON/TOML file (default {DEFAULT_RECIPE})")
    q.add_argument("--algorithm", help="override the recipe's algorithm (rtn, hqq)")
    q.add_argument("--out", help="output directory (default out/<model>-<recipe>)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    q.add_argument("--plot", action="store_true", help="write report.png next to the checkpoint")
    q.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    q.add_argument("--no-eval", action="store_true", help="skip the perplexity before/after")

    e = sub.add_parser("eval", help="perplexity and a greedy generation, optionally against a baseline")
    e.add_argument("--model", required=True, help="checkpoint or model directory (or 'default')")
    e.add_argument("--baseline", help="model to compare with (a path, or 'default' for SmolLM2-135M)")
    e.add_argument("--prompt", default=DEFAULT_PROMPT)
    e.add_argument("--max-new-tokens", type=int, default=32)
    e.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")

    for cmd in (q, e):
        cmd.add_argument("--threads", type=int, default=None,
                         help="torch CPU threads (default: torch's; 1 is fastest on a busy machine)")
        cmd.add_argument("--corpus", default="builtin",
                         help="'builtin' (Python's docstrings), a text file, or hf:NAME[/CONFIG] (a Hugging Face dataset)")
        cmd.add_argument("--seq-len", type=int, default=512, help="tokens per evaluation sequence")
        cmd.add_argument("--eval-sequences", type=int, default=8, help="number of evaluation sequences")

    sub.add_parser("formats", help="every registered format with its bits per element and error bound")
    sub.add_parser("recipes", help="the named recipe presets")
    i = sub.add_parser("inspect", help="what a checkpoint holds")
    i.add_argument("directory")
    return p


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval, "formats": cmd_formats, "recipes": cmd_recipes,
            "inspect": cmd_inspect}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            print("qtransform: error: --threads must be at least 1", file=sys.stderr)
            return 2
        import torch
        torch.set_num_threads(args.threads)
    try:
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"qtransform: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("qtransform: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
