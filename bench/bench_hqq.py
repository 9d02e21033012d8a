"""HQQ done right vs hqq 0.2.8 on all 210 linear weights of SmolLM2-135M-Instruct.

Side by side in one process, for uint4 g64, uint3 g64 and uint2 g16 (groups along
in_features, axis=1, float zero points), each method quantizes every weight to codes plus
parameters:

* ``rtn``: round-to-nearest, ``qt.choose_qparams`` + ``qt.quantize``;
* ``hqq``: ``hqq.core.quantize.Quantizer.quantize(optimize=True, bitpack=True)`` (hqq's default
  solver, float32 scale and zero: hqq's most favourable setting);
* ``ours (min MSE)``: ``qtransform.algorithms.hqq.optimize`` + ``qt.quantize`` with float16 scale
  and zero point (what a checkpoint stores), default options (zero point and scale refined,
  iterates ranked by squared error);
* ``ours (preset)``: the same with the options of the preset the command line uses
  (``hqq4-g64``, ``hqq3-g64``, ``hqq2-g16``): iterates ranked by the 4-norm of the group error,
  and at 4 bits the zero point alone refined.

Reported: wall time of the whole model (median of ``--repeat`` interleaved runs) and its ratio
to hqq, relative weight MSE ``sum ||W - W_q||^2 / sum ||W||^2`` over the 210 weights, and the
perplexity of the model with the dequantized weights on the built-in evaluation corpus
(Python docstrings, ``--sequences`` windows of ``--seq-len`` tokens), next to full precision.
The GGUF weights were stored as Q4_1 (uint4 g32), so these schemes are all lossy.

Run: ``python bench/bench_hqq.py`` (a few minutes on 2 cores); writes bench/results/hqq.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bridge/ next to qtransform/

import qtransform as qt  # noqa: E402
from bridge.app import corpus, evaluate, models  # noqa: E402
from common import markdown, timeit, write  # noqa: E402

warnings.filterwarnings("ignore")
METHODS = ("rtn", "hqq", "ours (min MSE)", "ours (preset)")
PRESETS = ("hqq4-g64", "hqq3-g64", "hqq2-g16")  # uint4 g64, uint3 g64, uint2 g16, groups along axis 1


def linear_weights(model) -> dict[str, torch.Tensor]:
    """Weights of every nn.Linear but the (tied) output head: SmolLM2-135M has 210."""
    return {f"{name}.weight": m.weight.detach() for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name != "lm_head"}


def run_ours(weights, spec, steps=("hqq",)):
    """The pipeline: the recipe's steps (HQQ with its options), then quantize_tree."""
    return qt.quantize_tree(weights, qt.Recipe(default=spec, steps=steps))


def run_rtn(weights, spec):
    return {k: qt.quantize(w, qt.choose_qparams(w, spec)) for k, w in weights.items()}


def run_hqq(weights, bits, group):
    from hqq.core.quantize import Quantizer

    return {k: Quantizer.quantize(w, nbits=bits, group_size=group, optimize=True, axis=1, bitpack=True,
                                  compute_dtype=torch.float32, device="cpu") for k, w in weights.items()}


def dequantized(method: str, out) -> dict[str, torch.Tensor]:
    if method != "hqq":
        return {k: qt.dequantize(q) for k, q in out.items()}
    from hqq.core.quantize import Quantizer

    return {k: Quantizer.dequantize(wq, {**meta, "compute_dtype": torch.float32}) for k, (wq, meta) in out.items()}


def relative_mse(weights, approx) -> float:
    num = sum(float((approx[k].float() - w).pow(2).sum()) for k, w in weights.items())
    return num / sum(float(w.pow(2).sum()) for w in weights.values())


def model_with(work, weights: dict[str, torch.Tensor]):
    params = dict(work.named_parameters())
    with torch.no_grad():
        for k, w in weights.items():
            params[k].copy_(w)
    return work


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="timing repeats (median)")
    ap.add_argument("--sequences", type=int, default=16, help="evaluation windows for perplexity")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per window")
    ap.add_argument("--no-ppl", action="store_true", help="skip perplexity")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads while timing (default 1: on this shared 2-core machine "
                         "hqq runs faster on one thread than on two, so that is the fair setting)")
    args = ap.parse_args(argv)

    model, tok = models.load_with_tokenizer()
    weights = linear_weights(model)
    numel = sum(w.numel() for w in weights.values())
    print(f"{len(weights)} linear weights, {numel / 1e6:.1f}M parameters", flush=True)
    seqs = corpus.token_sequences(corpus.load_text("builtin", part="eval"), tok, seq_len=args.seq_len,
                                  max_sequences=args.sequences)
    work = copy.deepcopy(model)
    ppl = (lambda w: evaluate.perplexity(model_with(work, w), seqs).perplexity) if not args.no_ppl else None
    fp_ppl = ppl(weights) if ppl else None
    print(f"full precision perplexity {fp_ppl}", flush=True)

    rows, table = [], []
    for name in PRESETS:
        preset = qt.get_preset(name)
        spec = preset.spec
        bits, group = spec.fmt.codec.bits, spec.granularity.size
        fns = {"rtn": lambda: run_rtn(weights, spec), "hqq": lambda: run_hqq(weights, bits, group),
               "ours (min MSE)": lambda: run_ours(weights, spec),
               "ours (preset)": lambda: run_ours(weights, spec, preset.steps)}
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        t = timeit(fns, repeat=args.repeat, warmup=0)
        torch.set_num_threads(threads)
        for method in METHODS:
            approx = dequantized(method, fns[method]())
            row = {"bits": bits, "group_size": group, "axis": 1, "method": method, "seconds": t[method],
                   "time_vs_hqq": t[method] / t["hqq"], "relative_mse": relative_mse(weights, approx),
                   "perplexity": ppl(approx) if ppl else None,
                   "options": dict(preset.steps[0].options) if method == "ours (preset)" else {}}
            rows.append(row)
            print(row, flush=True)
            table.append([f"uint{bits} g{group}", method, f"{t[method]:.2f} s",
                          f"{t['hqq'] / t[method]:.2f}x", f"{row['relative_mse']:.5f}",
                          "-" if row["perplexity"] is None else f"{row['perplexity']:.2f}"])
    head = ["scheme", "method", "time", "speed vs hqq", "rel. MSE", "perplexity"]
    note = (f"\n{len(weights)} weights ({numel / 1e6:.1f}M parameters) of SmolLM2-135M-Instruct; "
            f"perplexity on {seqs.numel()} tokens of the built-in corpus "
            f"({args.sequences} x {args.seq_len}); full precision: "
            + ("-" if fp_ppl is None else f"{fp_ppl:.2f}") + f"; timed on {args.threads} thread(s).")
    write("hqq", rows, markdown(head, table) + "\n" + note,
          extra={"model": models.DEFAULT_MODEL, "weights": len(weights), "parameters": numel,
                 "full_precision_perplexity": fp_ppl, "ppl_tokens": seqs.numel(), "repeat": args.repeat,
                 "timing_threads": args.threads})


if __name__ == "__main__":
    main()
