"""What ``qtransform quantize`` quantizes the model for: its task (``--task``), the class that loads it, the
options that mean something for it, and the processor its inputs go through.

=====================  ==========================================  =============  ==============================
task                   class (transformers)                        inputs         report's measure
=====================  ==========================================  =============  ==============================
causal-lm              the causal-LM / image-text-to-text class     corpus text    perplexity
feature-extraction     ``AutoModel`` (BertModel...)                 corpus text    embedding cosine vs float
text-classification    ``AutoModelForSequenceClassification``      corpus text    top-1 agreement, logits error
image-classification   ``AutoModelForImageClassification``         images         top-1 agreement, logits error
=====================  ==========================================  =============  ==============================

Without ``--task`` the task is the one whose transformers mapping holds the class ``config.json``'s
``architectures`` names (the first that any holds), else ``causal-lm`` (a GGUF file, the default model, a
config naming no known class: as the command always did); the report says which and why. A ``--task`` the
model's type has no class for is refused by name, as are options without a meaning for the task (images for a
text model, ``--corpus``/``--seq-len``/``--kv-cache`` for an image classifier, ``--eval-images`` for a causal
LM). Every task but ``causal-lm`` runs in memory (:mod:`bridge.app.driver`); its evaluation and calibration
data are :mod:`bridge.app.task_eval`'s.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from .inputs import UserError

__all__ = ["Task", "TASKS", "add_options", "resolve", "check_options", "architectures", "model_class", "load"]


class Task(NamedTuple):
    """A task: ``name``, the transformers ``auto`` class that loads it and the ``mapping`` of
    ``transformers.models.auto.modeling_auto`` its classes are in (``None`` for causal-lm, loaded as the command
    always did), the ``modality`` of its inputs (``"text"`` or ``"image"``) and, once resolved for a model,
    ``chosen``: how (``--task``, or what in ``config.json`` said so)."""

    name: str
    auto: str | None
    mapping: str | None
    modality: str
    chosen: str = ""


TASKS = {t.name: t for t in (
    Task("causal-lm", None, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "text"),
    Task("image-classification", "AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
         "image"),
    Task("text-classification", "AutoModelForSequenceClassification",
         "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "text"),
    Task("feature-extraction", "AutoModel", "MODEL_MAPPING_NAMES", "text"),
)}
#: The defaults of the evaluation options (cli.py's): a value other than these was given on the command line.
_DEFAULTS = {"corpus": "builtin", "seq_len": 512}


def add_options(q) -> None:
    """``--task`` and ``--eval-images`` of ``qtransform quantize``."""
    q.add_argument("--task", choices=tuple(TASKS),
                   help="what the model does (default: from config.json's architectures; causal-lm for GGUF files): "
                        "it picks the class that loads it, the calibration inputs and the report's quality measure")
    q.add_argument("--eval-images", metavar="DIR|synthetic",
                   help="image models: the held-out images the report compares the quantized model with the float "
                        "one on (the first --eval-sequences of DIR; default: synthetic images unlike the calibration's)")


def _classes(task: Task) -> dict:
    """``{model type: (class name, ...)}`` of ``task``'s transformers mapping."""
    from transformers.models.auto import modeling_auto

    names = dict(getattr(modeling_auto, task.mapping))
    if task.name == "causal-lm":
        names.update({k: v for k, v in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items() if k not in names})
    return {k: (v,) if isinstance(v, str) else tuple(v) for k, v in names.items()}


def _reads_text(name: str) -> bool:
    import transformers

    cls = getattr(transformers, name, None)
    return getattr(cls, "main_input_name", "input_ids") == "input_ids"


def _config(source) -> dict:
    try:
        config = json.loads((source.directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {source.directory / 'config.json'}: {e}") from None
    return config if isinstance(config, dict) else {}


def _detect(config: dict) -> Task:
    for name in config.get("architectures") or ():
        for task in TASKS.values():
            if any(name in names for names in _classes(task).values()) and (
                    task.modality != "text" or task.name == "causal-lm" or _reads_text(name)):
                return task._replace(chosen=f"detected: config.json's architectures name {name}")
    kind = config.get("model_type")
    return TASKS["causal-lm"]._replace(chosen=f"detected: model type {kind!r} names no class of another task"
                                       if kind else "detected: config.json names no architecture")


def resolve(a, source) -> Task:
    """The task of ``--model`` (``source``: a :class:`~bridge.app.models.ModelSource`): ``--task`` checked against
    the model's type, or detected from ``config.json`` (see the module docstring)."""
    name = getattr(a, "task", None)
    if source.gguf_file is not None or a.model is None:
        if name not in (None, "causal-lm"):
            raise UserError(f"--task {name}: {source.name} is a GGUF file, which holds a causal LM")
        return TASKS["causal-lm"]._replace(chosen="--task" if name else "a GGUF file holds a causal LM")
    config = _config(source)
    if name is None:
        return _detect(config)
    task, kind = TASKS[name], config.get("model_type")
    if name != "causal-lm":  # causal-lm: the class is bridge.stream.skeleton.class_for's, which refuses by name
        classes = _classes(task).get(kind)
        if not classes or (task.modality == "text" and not _reads_text(classes[0])):
            arch = ", ".join(config.get("architectures") or ()) or "the model"
            has = [t.name for t in TASKS.values() if t.name != name and kind in _classes(t)]
            raise UserError(f"--task {name}: {arch} (model type {kind!r}) has no {name} class in transformers"
                            + (f" (its tasks: {', '.join(has)})" if has else ""))
        if source.imported is not None:
            raise UserError(f"--task {name}: {a.model} is a {source.imported} checkpoint; the {name} task quantizes "
                            "a float transformers directory")
    return task._replace(chosen="--task")


def check_options(a, task: Task) -> None:
    """Refuse, by name, the options that have no meaning for ``task``."""
    what = f"task {task.name} ({task.chosen})"
    if task.modality == "text":
        for option, value in (("--calib-images", getattr(a, "calib_images", None)),
                              ("--eval-images", getattr(a, "eval_images", None))):
            if value and (option == "--eval-images" or task.name != "causal-lm"):
                raise UserError(f"{option} has no meaning for {what}: a text model, calibrated and evaluated on "
                                "--corpus text")
    else:
        for option, key in (("--corpus", "corpus"), ("--seq-len", "seq_len")):
            if getattr(a, key) != _DEFAULTS[key]:
                raise UserError(f"{option} has no meaning for {what}: an image model, calibrated on --calib-images "
                                "and evaluated on --eval-images")
        from .images import read_pairs

        for option, value in (("--calib-images", a.calib_images), ("--eval-images", a.eval_images)):
            if value not in (None, "synthetic"):
                read_pairs(value, option)  # its files read before the model loads: a bad one named first
    if task.name != "causal-lm":
        for option, value in (("--kv-cache", a.kv_cache), ("--stream", a.stream), ("--resume", a.resume),
                              ("--max-memory", a.max_memory)):
            if value:
                raise UserError(f"{option} has no meaning for {what}"
                                + (": it has no key/value cache to quantize" if option == "--kv-cache" else
                                   ": it runs in memory"))


def architectures(source) -> list:
    """The class names ``config.json`` of ``source`` lists under ``architectures``."""
    return list(_config(source).get("architectures") or ())


def model_class(task: Task, source):
    """The class ``task`` loads ``source`` as: the one ``config.json``'s ``architectures`` names where the task's
    mapping holds it, else the task's auto class; ``None`` for causal-lm (:func:`bridge.app.models.load_causal_lm`)."""
    import transformers

    if task.auto is None:
        return None
    known = {n for names in _classes(task).values() for n in names}
    for name in _config(source).get("architectures") or ():
        if name in known and isinstance(getattr(transformers, name, None), type):
            return getattr(transformers, name)
    return getattr(transformers, task.auto)


def load(task: Task, source):
    """``(model, processor)`` of ``source`` for ``task`` (not causal-lm): the model in float32 and eval mode, every
    tensor read (a tensor the checkpoint lacks is refused by name, never random), and its tokenizer (text) or
    image processor (images, from ``preprocessor_config.json``)."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    from ..checkpoint import CheckpointError
    from .loadcheck import check_quantized_without_config
    from .models import _check_every_tensor_read

    directory = str(source.directory)
    try:
        check_quantized_without_config(source)
        model, info = model_class(task, source).from_pretrained(directory, dtype=torch.float32, output_loading_info=True,
                                                                local_files_only=True)
        _check_every_tensor_read(source, info)
    except CheckpointError as e:
        raise UserError(f"cannot load model {directory}: {str(e).splitlines()[0]}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot load model {directory} for {task.name}: {type(e).__name__}: "
                        f"{(str(e).strip().splitlines() or [''])[0]}") from None
    auto = AutoTokenizer if task.modality == "text" else AutoImageProcessor
    try:
        processor = auto.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = "tokenizer" if task.modality == "text" else "image processor (preprocessor_config.json)"
        raise UserError(f"--model {directory}: no {what} for {task.name} ({type(e).__name__})") from None
    return model.eval(), processor
