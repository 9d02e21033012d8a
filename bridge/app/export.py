"""``qtransform export CHECKPOINT --to TARGET --out DIR`` and ``qtransform quantize --to TARGET``.

The targets are :data:`bridge.interop.EXPORTERS` (``qtransform export --help`` lists them). A
checkpoint the target cannot hold is refused with every tree path it cannot express, before
anything is written; ``quantize --to`` checks the recipe's specs against the target before the
model is quantized, and writes the export beside the checkpoint (``--export-out``, default
``<out>-<target>``) after it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import outputs
from .inputs import UserError

__all__ = ["add_parser", "add_quantize_options", "check_plan", "export_after_quantize", "cmd_export"]


def _targets() -> list[str]:
    from .. import interop

    return sorted(interop.EXPORTERS)


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``export`` subcommand."""
    x = sub.add_parser("export", help="write a qtransform checkpoint in another tool's format")
    x.add_argument("checkpoint", help="a qtransform checkpoint directory")
    x.add_argument("--to", required=True, metavar="TARGET", help=f"target format: {', '.join(_targets())}")
    x.add_argument("--out", required=True, help="output directory")
    x.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    x.add_argument("--allow-nearest", action="store_true",
                   help="accept specs the target holds only approximately (its nearest format)")
    return x


def add_quantize_options(q: argparse.ArgumentParser) -> None:
    """``--to`` and ``--export-out`` on ``quantize``."""
    q.add_argument("--to", metavar="TARGET", help=f"also export the checkpoint to this format ({', '.join(_targets())})")
    q.add_argument("--export-out", metavar="DIR", help="where --to writes (default <out>-<target>)")
    q.add_argument("--allow-nearest", action="store_true", help="with --to: accept the target's nearest formats")


def _export_dir(a, out: Path) -> Path:
    return Path(a.export_out) if a.export_out else out.with_name(f"{out.name}-{a.to}")


def check_plan(a, plan, out: Path, carried=()) -> None:
    """Before quantizing: the ``--to`` target holds every spec of ``plan`` and the input's ``carried`` tensors
    (:mod:`bridge.stream.inventory`), and its directory is free."""
    if getattr(a, "to", None) is None:
        if getattr(a, "export_out", None):
            raise UserError("--export-out needs --to")
        return
    from .. import interop

    if a.to not in interop.EXPORTERS:
        raise UserError(f"--to must be one of {', '.join(_targets())}, got {a.to!r}")
    exporter = interop.EXPORTERS[a.to]
    bad = []
    for path, spec in plan.specs.items():
        s = exporter.support(spec, "weight")
        if s.kind == "no" or (s.kind == "nearest" and not a.allow_nearest):
            bad.append(f"{path}: {spec}: {s.note}")
    if carried and not getattr(exporter, "carries", False):
        raise UserError(f"--to {a.to} cannot hold the {len(carried)} tensor(s) of the input that the model does not load "
                        f"and the checkpoint keeps as stored ({', '.join(sorted(carried)[:4])}"
                        f"{', ...' if len(carried) > 4 else ''}); export to a format that carries them")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise UserError(f"--to {a.to} cannot hold {len(bad)} tensor(s) of this recipe: " + "; ".join(bad[:5]) + more)
    target = _export_dir(a, out)
    if target.resolve() == out.resolve():
        raise UserError(f"--export-out {target} is the checkpoint directory")
    outputs.check_out_dir(target, overwrite=a.overwrite, option="--export-out")


def export_after_quantize(a, out: Path) -> Path | None:
    """After the checkpoint is written: the ``--to`` export (``None`` without ``--to``)."""
    if getattr(a, "to", None) is None:
        return None
    return _run(out, a.to, _export_dir(a, out), overwrite=a.overwrite, allow_nearest=a.allow_nearest)


def _run(checkpoint: Path, to: str, out: Path, *, overwrite: bool, allow_nearest: bool) -> Path:
    from .. import interop

    try:
        return interop.export(checkpoint, to=to, out=out, overwrite=overwrite, allow_nearest=allow_nearest)
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from None


def cmd_export(a) -> int:
    src = Path(a.checkpoint)
    if not src.is_dir():
        raise UserError(f"{src}: not a checkpoint directory")
    out = _run(src, a.to, Path(a.out), overwrite=a.overwrite, allow_nearest=a.allow_nearest)
    print(f"wrote {out} ({a.to})", flush=True)
    return 0
