"""Calibration and evaluation data of ``qtransform quantize`` for the tasks other than causal-lm
(:mod:`bridge.app.tasks`), and the report's quality measure of each: the quantized model against the float one
on the same held-out inputs.

- text (feature-extraction, text-classification): calibration is the first ``--calib N`` passages (blank-line
  separated paragraphs of at least four words) of the corpus's calibration part, the held-out inputs the first
  ``--eval-sequences`` of its evaluation part (disjoint for the built-in corpus), each tokenized as the model
  reads it (special tokens, truncated to ``--seq-len``), padded per batch of ``--calib-batch`` with the attention
  mask: static activation ranges then see the [CLS]/[SEP] tokens whose activations are an encoder's largest.
- images (image-classification): calibration is ``--calib N`` images, of ``--calib-images DIR`` (in name
  order, repeated when DIR holds fewer) or synthetic (:func:`bridge.app.images.synthetic_images`, seed 0); the
  held-out images are the first ``--eval-sequences`` of ``--eval-images DIR``, or synthetic ones of seed 1; both
  through the model's image processor.

Measures (:meth:`Probe.after`): feature-extraction, the mean (and least) cosine similarity of the sentence
embeddings (the last hidden state mean-pooled over the attention mask) of the float and the quantized model;
classification, the top-1 agreement (the fraction of inputs whose arg-max class is the float model's) and the
relative logits error ``||L_q - L_f||_F / ||L_f||_F``.
"""

from __future__ import annotations

import torch

from . import images, inputs
from .inputs import UserError

__all__ = ["passages", "text_batch", "image_batch", "calibration", "Probe", "probe", "quality_rows"]


def passages(text: str, n: int, source: str, option: str = "--eval-sequences") -> list[str]:
    """The first ``n`` paragraphs (blank-line separated, whitespace collapsed) of ``text`` with four words or more."""
    found = [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) >= 4]
    if len(found) < n:
        raise UserError(f"corpus {source!r} holds {len(found)} passages of four words or more, {option} asks for {n}")
    return found[:n]


def text_batch(tokenizer, texts: list[str], seq_len: int) -> dict:
    """``texts`` as one padded batch (``input_ids``, ``attention_mask``...), truncated to ``seq_len`` tokens."""
    if tokenizer.pad_token is None:
        raise UserError(f"the model's tokenizer ({type(tokenizer).__name__}) has no padding token to batch the "
                        "held-out texts")
    got = tokenizer(texts, padding=True, truncation=True, max_length=seq_len, return_tensors="pt")
    return {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}


def image_batch(processor, pictures: list) -> dict:
    """``{"pixel_values": (n, 3, H, W)}`` of ``pictures`` (PIL images) through the model's image processor."""
    try:
        return {"pixel_values": processor(images=pictures, return_tensors="pt")["pixel_values"]}
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"the model's image processor ({type(processor).__name__}) refuses the images: {e}") from None


def _pictures(source: str | None, n: int, *, seed: int, option: str) -> tuple[list, str]:
    if source in (None, "synthetic"):  # 224 pixels square; the processor resizes them as it resizes any image
        return images.synthetic_images(n, seed=seed), "synthetic images (gradients and shapes)"
    pairs = images.read_pairs(source, option)
    return [pairs[i % len(pairs)][0] for i in range(n)], f"images of {source}"


def calibration(a, task, model, processor, text: str | None) -> tuple[list | None, list]:
    """``(batches, notes)`` of ``--calib N`` for ``task`` (``None`` without ``--calib``)."""
    if not a.calib:
        return None, []
    if task.modality == "text":  # passages as the model reads them: special tokens, padding, attention mask
        texts = passages(text, a.calib, a.corpus, "--calib")
        batches = [text_batch(processor, texts[i:i + a.calib_batch], a.seq_len) for i in range(0, a.calib, a.calib_batch)]
        inputs.check_vocab(model, batches, "calibration text")
        return batches, [f"calibrated on {a.calib} passages of the {a.corpus} corpus's calibration part (at most "
                         f"{a.seq_len} tokens each, padded per batch of {a.calib_batch})"]
    pictures, what = _pictures(a.calib_images, a.calib, seed=0, option="--calib-images")
    pixels = image_batch(processor, pictures)["pixel_values"]
    return ([{"pixel_values": p} for p in torch.split(pixels, a.calib_batch)],
            [f"calibrated on {a.calib} images: {what}"])


def _device(model) -> torch.device:
    return next(model.parameters()).device


class Probe:
    """The held-out ``batch`` of ``task`` and the float model's outputs on it (:meth:`before`), which
    :meth:`after` compares the quantized model's with; ``what``: the inputs in words."""

    def __init__(self, task, batch: dict, what: str):
        self.task, self.batch, self.what = task, batch, what
        self.samples = int(next(iter(batch.values())).shape[0])
        self.reference = None

    def outputs(self, model) -> torch.Tensor:
        """The embeddings ``(n, hidden)`` (feature-extraction) or logits ``(n, classes)`` of ``model``."""
        device = _device(model)
        batch = {k: v.to(device) for k, v in self.batch.items()}
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(**batch)
        finally:
            model.train(was)
        if self.task.name != "feature-extraction":
            return out.logits.float().cpu()
        h = out.last_hidden_state.float()
        mask = batch.get("attention_mask", torch.ones(h.shape[:2], device=h.device)).to(h.dtype).unsqueeze(-1)
        return ((h * mask).sum(1) / mask.sum(1).clamp(min=1)).cpu()

    def before(self, model) -> None:
        self.reference = self.outputs(model)

    def after(self, model) -> dict:
        """The report's quality record of ``model`` against the float outputs :meth:`before` kept."""
        got, ref = self.outputs(model), self.reference
        record = {"task": self.task.name, "samples": self.samples, "inputs": self.what}
        if self.task.name == "feature-extraction":
            cos = torch.nn.functional.cosine_similarity(got.double(), ref.double(), dim=-1)
            return record | {"embedding_cosine": float(cos.mean()), "embedding_cosine_min": float(cos.min())}
        agree = (got.argmax(-1) == ref.argmax(-1)).double().mean()
        error = torch.linalg.vector_norm((got - ref).double()) / torch.linalg.vector_norm(ref.double())
        return record | {"top1_agreement": float(agree), "rel_logits_error": float(error)}


def probe(a, task, model, processor, text: str | None) -> Probe | None:
    """The held-out inputs of ``task`` (``None`` with ``--no-eval``)."""
    if a.no_eval:
        return None
    if task.modality == "text":
        batch = text_batch(processor, passages(text, a.eval_sequences, a.corpus), a.seq_len)
        inputs.check_vocab(model, [batch], "evaluation text")
        return Probe(task, batch, f"passages of the {a.corpus} corpus's evaluation part")
    pictures, what = _pictures(a.eval_images, a.eval_sequences, seed=1, option="--eval-images")
    return Probe(task, image_batch(processor, pictures), what)


def quality_rows(quality: dict) -> list[list[str]]:
    """The report's summary rows ``[measure, before, after]`` of a :meth:`Probe.after` record."""
    n = f"{quality['samples']} held-out"
    if "embedding_cosine" in quality:
        return [[f"embedding cosine vs float ({n} texts)", "1", f"{quality['embedding_cosine']:.5f} "
                 f"(least {quality['embedding_cosine_min']:.5f})"]]
    return [[f"top-1 agreement with float ({n})", "1", f"{quality['top1_agreement']:.4f}"],
            ["relative logits error", "0", f"{quality['rel_logits_error']:.5f}"]]
