"""Tiny checkpoints on disk for the streaming tests, and the command run in this process."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from bridge.app.cli import main

from bridge_util import tiny_causal_lm
import tiny_lm

#: the model files of a checkpoint (report.json differs: times, peak memory)
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def save_tiny(arch: str, directory: Path, *, dtype=torch.bfloat16, shard="40KB", seed: int = 0) -> Path:
    """A tiny untrained ``arch`` model saved in ``dtype`` (sharded) with the tiny tokenizer."""
    torch.manual_seed(seed)
    model = tiny_causal_lm(arch).eval().to(dtype)
    model.save_pretrained(directory, max_shard_size=shard)
    tiny_lm.tokenizer().save_pretrained(directory)
    return directory


def quantize(model_dir: Path, out: Path, preset: str, *extra: str) -> dict:
    """``qtransform quantize`` in this process, in memory unless ``extra`` says ``--stream`` (a checkpoint
    directory streams by default: the comparisons name both drivers); returns its report."""
    driver = () if "--stream" in extra else ("--in-memory",)
    rc = main(["quantize", "--model", str(model_dir), "--recipe", preset, "--out", str(out), "--threads", "1",
               "--seq-len", "16", "--eval-sequences", "1", *driver, *extra])
    assert rc == 0
    return json.loads((out / "report.json").read_text())


def digests(directory: Path) -> dict[str, str]:
    """``{file: sha256}`` of every file of a checkpoint but its report."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(directory).iterdir())
            if p.is_file() and p.name not in ("report.json", "report.png")}


def stored_dtype(directory: Path, name: str) -> torch.dtype:
    """The dtype tensor ``name`` is stored in, in the checkpoint ``directory`` (sharded or not)."""
    from bridge.stream import Source

    return Source(directory).tensors[name].dtype


def in_memory(source: Path, out: Path, recipe, calibration=None, **save) -> None:
    """What the command does without ``--stream``, from Python: the model loaded in float32, quantized, saved
    with the float tensors in their stored dtypes."""
    from transformers import AutoModelForCausalLM

    import bridge
    from bridge.stream import Source
    from bridge.stream.driver import stored_dtypes_of

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    plan = bridge.plan(model, recipe)
    dtypes = stored_dtypes_of(Source(source), model)
    qmodel = bridge.quantize(model, plan, calibration=calibration)
    bridge.save(qmodel, out, recipe=recipe, rules={p: plan[p].rule for p in plan.specs}, dtypes=dtypes, **save)
