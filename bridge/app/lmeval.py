"""lm-evaluation-harness on a model we loaded: ``qtransform eval --model DIR --tasks NAME[,NAME]``.

The harness's own command line loads a checkpoint with ``from_pretrained`` in a process that never
imports :mod:`bridge`, so our checkpoints (``quant_method: qtransform``) do not load there. Here the
model is loaded by us (:func:`bridge.app.inputs.model_and_tokenizer`: our checkpoints, Quark and
compressed-tensors directories, GGUF files) and handed, with its tokenizer, to the harness's
``HFLM`` wrapper and ``lm_eval.simple_evaluate`` (the harness's Python API). ``lm_eval`` is an
optional extra: ``pip install 'qtransform[eval]'``.

Tasks are the harness's names (``hellaswag``, ``arc_easy``: their datasets come from the Hugging Face
hub) or tasks of your own: a directory of task YAML files given as ``include_path`` (the harness's
``TaskManager(include_path=...)``), whose dataset may be a local file (``dataset_path: json`` with
``dataset_kwargs: {data_files: {test: FILE.jsonl}}``), or the path of one task YAML file.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

__all__ = ["INSTALL", "harness", "parse_tasks", "task_manager", "evaluate", "metric_rows", "summary", "add_options",
           "cmd_eval_tasks"]

#: What to install when ``lm_eval`` is missing.
INSTALL = "pip install 'qtransform[eval]'"


def harness():
    """The ``lm_eval`` module; an ImportError that says what to install when it is missing."""
    import importlib

    try:
        lm_eval = importlib.import_module("lm_eval")
        importlib.import_module("lm_eval.models.huggingface")  # HFLM: it needs accelerate (lm_eval[hf])
    except ImportError as e:
        raise ImportError(f"--tasks needs lm-evaluation-harness with its transformers models (lm_eval[hf]), "
                          f"which does not import here ({e}): {INSTALL}") from None
    return lm_eval


def parse_tasks(text: str) -> list[str]:
    """Task names from ``--tasks`` (spaces around names dropped, each once); a ValueError for an empty list or name.

    >>> parse_tasks("arc_easy, hellaswag,arc_easy")
    ['arc_easy', 'hellaswag']
    """
    if not isinstance(text, str):
        raise TypeError(f"--tasks must be a string of comma-separated names, got {type(text).__name__}")
    names = [n.strip() for n in text.split(",")]
    if not text.strip() or any(not n for n in names):
        raise ValueError(f"--tasks: expected NAME[,NAME...], got {text!r}")
    return list(dict.fromkeys(names))  # in order, each once


def _include_dirs(include_path) -> list[Path]:
    if include_path is None:
        return []
    paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
    dirs = [Path(p) for p in paths]
    for d in dirs:
        if not d.is_dir():
            raise ValueError(f"--include-path: {d} is not a directory")
    return dirs


def _is_yaml_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) and Path(name).is_file()


def task_manager(tasks: list[str], include_path=None):
    """The harness's ``TaskManager`` that knows every name of ``tasks``; a ValueError naming the unknown ones.

    A name is a registered task, group or tag (the harness's, or one defined in the YAML files under
    ``include_path``, a directory or a list of them) or the path of a task YAML file. When every name
    is a task file or a task (not a group or tag, which may name the harness's tasks) found under
    ``include_path``, the harness's own ~15000 tasks are not indexed (seconds saved).
    """
    harness()
    from lm_eval.tasks import TaskManager

    dirs = _include_dirs(include_path)
    wanted = [t for t in tasks if not _is_yaml_file(t)]
    local = TaskManager(include_path=[str(d) for d in dirs] or None, include_defaults=False)
    if all(t in local.all_subtasks for t in wanted):
        return local
    manager = TaskManager(include_path=[str(d) for d in dirs] or None)
    unknown = [t for t in wanted if t not in manager.all_tasks]
    if unknown:
        where = f" nor under --include-path {', '.join(map(str, dirs))}" if dirs else ""
        listed = ", ".join(repr(t) for t in unknown)
        raise ValueError(f"--tasks: unknown task{'s' if len(unknown) > 1 else ''} {listed} (not one of "
                         f"lm-eval's {len(manager.all_tasks)} tasks{where}; `lm-eval ls tasks` lists them, "
                         f"--include-path DIR adds your own YAML tasks)")
    return manager


def _positive_int(value, name: str, *, low: int = 1):
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@contextlib.contextmanager
def _quiet(level=logging.ERROR):
    """The harness's log (its advice on pre-built models, default aggregations) at ``level`` meanwhile."""
    log = logging.getLogger("lm_eval")
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)


def evaluate(model, tokenizer, tasks, *, include_path=None, manager=None, limit: int | None = None,
             num_fewshot: int | None = None, batch_size: int = 1, log_samples: bool = False,
             quiet: bool = True) -> dict:
    """Run the harness on ``model`` (a loaded transformers causal LM, ours or any) with ``tokenizer``.

    ``tasks``: names (or a ``"a,b"`` string); ``limit``: at most that many documents per task (the
    first ones); ``num_fewshot``: examples in each prompt (the task's default without it);
    ``manager``: a :func:`task_manager` already built for ``tasks``. Returns the harness's result
    dict (``results``, ``n-samples``, ``versions``, ``configs``...; ``samples`` with ``log_samples``).
    The model runs where it is, in eval mode (restored after), without gradients.
    """
    names = parse_tasks(tasks) if isinstance(tasks, str) else list(tasks)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
    limit = _positive_int(limit, "limit")
    num_fewshot = _positive_int(num_fewshot, "num_fewshot", low=0)
    batch_size = _positive_int(batch_size, "batch_size")
    lm_eval = harness()
    from lm_eval.models.huggingface import HFLM
    import torch

    manager = task_manager(names, include_path) if manager is None else manager
    was_training = model.training
    try:
        with (_quiet() if quiet else contextlib.nullcontext()), torch.no_grad():
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
            return lm_eval.simple_evaluate(lm, tasks=names, task_manager=manager, limit=limit,
                                           num_fewshot=num_fewshot, log_samples=log_samples)
    finally:
        model.train(was_training)


def _metrics(task_result: dict):
    """``(metric, value, stderr)`` of one task's result (keys ``"acc,none"``, ``"acc_stderr,none"``)."""
    for key, value in task_result.items():
        if "," not in key or "_stderr," in key:
            continue
        metric, filt = key.split(",", 1)
        stderr = task_result.get(f"{metric}_stderr,{filt}")
        yield (metric if filt == "none" else f"{metric} ({filt})"), value, stderr


def _number(value, stderr=None) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    text = f"{value:.4f}"
    return text + (f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else "")


def metric_rows(runs: list[tuple[str, dict]]) -> list[list[str]]:
    """A table (header first) of every task and metric, one column per ``(role, harness result)``."""
    first = runs[0][1]
    rows = [["task", "docs", "metric", *(role for role, _ in runs)]]
    for task, res in first["results"].items():
        docs = first.get("n-samples", {}).get(task, {}).get("effective", "")
        for metric, _, _ in _metrics(res):
            cells = []
            for _, out in runs:
                found = {m: (v, s) for m, v, s in _metrics(out["results"].get(task, {}))}
                cells.append(_number(*found[metric]) if metric in found else "")
            rows.append([res.get("alias", task).strip(), str(docs), metric, *cells])
    return rows


def summary(result: dict) -> dict:
    """The JSON-able part of a harness result that a report keeps: metrics, documents, versions, shots."""
    keep = ("results", "groups", "n-samples", "n-shot", "versions", "higher_is_better", "lm_eval_version")
    return {k: result[k] for k in keep if k in result}


def add_options(e, at_least) -> None:
    """``qtransform eval``'s harness options (``at_least(n)``: the command's integer >= n type)."""
    e.add_argument("--tasks", metavar="NAME[,NAME]",
                   help="run lm-evaluation-harness tasks instead of the perplexity (needs " + INSTALL + ")")
    e.add_argument("--include-path", action="append", metavar="DIR",
                   help="a directory of your own harness task YAML files (repeatable)")
    e.add_argument("--limit", type=at_least(1), metavar="N", help="--tasks: the first N documents of each task")
    e.add_argument("--num-fewshot", type=at_least(0), metavar="K", help="--tasks: K examples in each prompt")
    e.add_argument("--batch-size", type=at_least(1), default=1, metavar="B", help="--tasks: requests per forward pass")


def cmd_eval_tasks(a) -> int:
    """``qtransform eval --model DIR --tasks NAME[,NAME] [--baseline PATH]``: the harness on each model."""
    import json

    from . import inputs, outputs
    from .outputs import say
    from .report import table

    names = parse_tasks(a.tasks)
    try:
        manager = task_manager(names, a.include_path)  # every name known before a model loads
    except ImportError as e:
        raise inputs.UserError(str(e)) from None
    if a.json:
        outputs.check_file_target(Path(a.json), option="--json")
    targets = [("model", a.model)] + ([("baseline", a.baseline)] if a.baseline else [])
    sources = [inputs.model_source(None if path == "default" else path) for _, path in targets]
    runs, report = [], []
    for (role, path), source in zip(targets, sources):
        say(f"loading {role} {path} ...")
        model, tokenizer = inputs.model_and_tokenizer(None if path == "default" else path, source=source)
        say(f"lm-eval {', '.join(names)} on {role}" + (f" (first {a.limit} documents)" if a.limit else "") + " ...")
        result = evaluate(model, tokenizer, names, manager=manager, limit=a.limit, num_fewshot=a.num_fewshot,
                          batch_size=a.batch_size)
        runs.append((role, result))
        report.append({"role": role, "model": path, **summary(result)})
        del model
    say()
    say("\n".join(table(metric_rows(runs))))
    if a.json:
        from lm_eval.utils import handle_non_serializable

        text = json.dumps({"tasks": names, "limit": a.limit, "num_fewshot": a.num_fewshot, "results": report},
                          indent=2, default=handle_non_serializable)
        outputs.write_text(Path(a.json), text + "\n", option="--json")
    return 0
