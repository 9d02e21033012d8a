"""Image-text calibration of vision-language models from the command line (``--calib-images``).

A vision-language model's language model sees, at run time, a token stream in which the image tokens hold the
projector's outputs. Calibrated on text alone, its statistics miss them. With ``--calib N`` on a model with a
vision tower (:func:`bridge.arch.towers`) and a processor in its directory (``AutoProcessor``: the image
processor and the tokenizer with its image tokens), each calibration batch is one image with its text, made by
the model's own processor, so the first block's inputs are the multimodal stream the model builds:

- ``--calib-images DIR``: the images in DIR (``.png``, ``.jpg``, ``.jpeg``, ``.bmp``, ``.webp``, in name order),
  each with the text of a ``.txt`` file of the same stem when there is one, else a piece of the corpus's
  calibration text;
- ``--calib-images FILE.jsonl``: one ``{"image": path, "text": caption}`` per line (paths relative to the file);
- ``--calib-images synthetic`` (the default for such a model): deterministic synthetic images (colour gradients
  and shapes), each with a piece of the corpus's calibration text, said in the report.

The prompt is the processor's chat template with one image and the text where it has one, else the processor's
image token followed by the text. A model without a processor is calibrated on text, said in the report; bad
input names the file and the line.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .inputs import UserError

__all__ = ["image_calibration", "synthetic_images", "read_pairs", "IMAGE_SUFFIXES"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def synthetic_images(n: int, size: int = 224, seed: int = 0) -> list:
    """``n`` deterministic RGB images: a colour gradient per image with a few filled shapes on it."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a, b = (torch.rand(3, generator=g) * 255).tolist(), (torch.rand(3, generator=g) * 255).tolist()
        t = torch.linspace(0, 1, size)
        ramp = torch.stack([x + (y - x) * t for x, y in zip(a, b)], -1)  # (size, 3) along the width
        pixels = ramp.expand(size, size, 3).to(torch.uint8).numpy()
        img = Image.fromarray(pixels, "RGB")
        draw = ImageDraw.Draw(img)
        for _ in range(3):
            x0, y0 = (torch.rand(2, generator=g) * size * 0.7).tolist()
            w, h = (torch.rand(2, generator=g) * size * 0.3 + 4).tolist()
            fill = tuple(int(v) for v in (torch.rand(3, generator=g) * 255).tolist())
            (draw.ellipse if torch.rand(1, generator=g) < 0.5 else draw.rectangle)([x0, y0, x0 + w, y0 + h], fill=fill)
        out.append(img)
    return out


def _open(path: Path, where: str, option: str = "--calib-images"):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise UserError(f"{option}: {where}: cannot read image {path} ({e})") from None


def read_pairs(source: str, option: str = "--calib-images") -> list:
    """``[(image, caption or None)]`` of a ``--calib-images`` directory or JSONL file (see the module docstring);
    errors name ``option``."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise UserError(f"{option}: {path} holds no image ({', '.join(IMAGE_SUFFIXES)})")
        return [(_open(f, str(path), option), f.with_suffix(".txt").read_text().strip() if f.with_suffix(".txt").is_file()
                 else None) for f in files]
    if path.is_file() and path.suffix.lower() == ".jsonl":
        out = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{option}: {path} line {i}: not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("image"), str) or not isinstance(row.get("text", ""), str):
                raise UserError(f"{option}: {path} line {i}: needs {{\"image\": path, \"text\": caption}}")
            out.append((_open(path.parent / row["image"], f"{path} line {i}", option), row.get("text") or None))
        if not out:
            raise UserError(f"{option}: {path} holds no line")
        return out
    raise UserError(f"{option}: {source} is neither a directory of images, a .jsonl file nor 'synthetic'")


def _processor(directory: Path):
    """The model's processor with an image processor, else ``None``."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return proc if getattr(proc, "image_processor", None) is not None else None


def _prompt(proc, text: str) -> str:
    if getattr(proc, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        return proc.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    token = getattr(proc, "image_token", None)
    if not isinstance(token, str):
        raise UserError(f"--calib-images: the model's processor ({type(proc).__name__}) has neither a chat template "
                        "nor an image token to place the image in its text")
    return f"{token} {text}"


def image_calibration(a, directory: Path | None, model, tokenizer, text: str | None):
    """``(batches, notes)`` of image-text calibration for ``model`` (see the module docstring), or ``(None, notes)``
    where it calibrates on text (no tower, or no processor: said in ``notes``)."""
    from ..arch import towers

    source = getattr(a, "calib_images", None)
    if not a.calib or not towers(model):
        if source:
            raise UserError("--calib-images calibrates a vision-language model (one with a vision tower) with --calib N; "
                            f"{type(model).__name__} has no vision tower" if a.calib else "--calib-images needs --calib N")
        return None, []
    proc = None if directory is None else _processor(directory)
    if proc is None:
        if source:
            raise UserError(f"--calib-images: {directory} holds no processor (preprocessor_config.json) for the images")
        return None, [f"calibrated on text only: {directory} holds no image processor for {type(model).__name__}'s "
                      "vision tower (save its processor with the model to calibrate on images)"]
    synthetic = source in (None, "synthetic")
    pairs = [(img, None) for img in synthetic_images(a.calib)] if synthetic else read_pairs(source)
    words = (text or "").split()
    chunk = max(1, a.seq_len // 2)
    batches = []
    for i in range(a.calib):
        img, caption = pairs[i % len(pairs)]
        body = caption or " ".join(words[i * chunk:(i + 1) * chunk]) or "Describe the image."
        try:
            got = proc(images=[img], text=[_prompt(proc, body)], return_tensors="pt")
        except (ValueError, TypeError) as e:
            raise UserError(f"--calib-images: the model's processor ({type(proc).__name__}) refuses image {i}: {e}") from None
        batches.append({k: v for k, v in got.items() if isinstance(v, torch.Tensor)})
    what = "synthetic images (gradients and shapes)" if synthetic else f"images of {source}"
    return batches, [f"calibrated on {len(batches)} image-text pairs through {type(proc).__name__}: {what}"
                     + (" with the corpus's calibration text" if synthetic or any(c is None for _, c in pairs) else "")]
