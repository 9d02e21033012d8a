"""Intel's AutoRound AutoScheme (mixed precision by "delta loss" and a knapsack over layer schemes) on a float model
directory, for bench/bench_autoscheme.py. Run with the python of a virtualenv holding ``auto-round``
(``/tmp/qtransform-autoround/bin/python``).

AutoScheme scores every candidate scheme by quantizing all layers with it and accumulating, per layer,
``sum |dL/dW_q * (W - W_q)|`` (the language-model loss's gradient at the quantized weights times the weight
error, a first-order estimate of the loss change) over the calibration samples, then picks one scheme per layer
by a dynamic program over total bits (auto-round's own count) under ``avg_bits``. Here it runs with ``iters=0``:
the chosen schemes are then applied by round to nearest (``disable_opt_rtn``: plain RTN, as our ``rtn``; without
it auto-round's iters=0 path searches scales with an activation-weighted error, ``--opt-rtn``).

Calibration: AutoScheme takes a dataset *name* and tokenizes text itself; to give it the exact token ids the
main script wrote, this script replaces ``get_dataloader`` (the one function through which AutoScheme and
AutoRound's calibration read their data: ``auto_round.auto_scheme.delta_loss`` and ``auto_round.calib_dataset``)
by a loader over those ids, ``batch_size`` rows at a time. AutoScheme's score cache goes to a directory beside
the token file (``AR_AUTO_SCHEME_CACHE``): the budgets of one bench run reuse the first run's scores
(``scores_cached`` in the result), as ours reuse one measurement; its key does not see the tokens.

The model is scored as auto-round leaves it in memory (weights fake-quantized in place); the script refuses a
result unless every quantized linear holds at most ``2**bits`` distinct values in each group of its chosen
scheme. Bits per weight are counted two ways: auto-round's (``compute_layer_bits``: codes + a 16-bit scale + a
``bits``-bit zero point per group, the zero point counted even for symmetric schemes) and ours (what the weight
needs stored: codes + one float16 scale per group for a symmetric scheme, + an integer zero point of ``bits``
bits for an asymmetric one).

    /tmp/qtransform-autoround/bin/python bench/peer_autoscheme.py --model DIR --tokens calib.pt --eval eval.pt \\
        --avg-bits 4.25 --options W2A16,W3A16,W4A16,W8A16 --threads 1 --out result.json [--opt-rtn]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from peer_llmcompressor import perplexity


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--avg-bits", type=float, required=True, help="AutoScheme's target, auto-round's own count")
    ap.add_argument("--options", default="W2A16,W3A16,W4A16,W8A16")
    ap.add_argument("--batch-size", type=int, default=4, help="calibration rows per AutoScheme step")
    ap.add_argument("--opt-rtn", action="store_true", help="auto-round's optimized RTN (default: plain RTN)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    return ap


def token_loader(ids: torch.Tensor, batch_size: int):
    """``get_dataloader``'s replacement: the given ``(n, seq_len)`` ids, ``batch_size`` rows per batch, as the
    dicts auto-round's loaders yield."""
    def loader(tokenizer, seqlen, dataset_name=None, seed=42, bs=8, nsamples=512):
        rows = ids[:nsamples]
        return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in rows.split(batch_size)]
    return loader


def our_bits(n_param: int, shape: tuple[int, int], bits: int, group: int, sym: bool) -> float:
    """Stored bits of one layer's weight: codes, one float16 scale per group, an integer zero point of ``bits``
    bits per group when asymmetric (groups along in_features; the last group of a row may be short)."""
    out_f, in_f = shape
    groups = out_f * (math.ceil(in_f / group) if group > 0 else 1)
    return bits * n_param + groups * (16 + (0 if sym else bits))


def main() -> None:
    a = parser().parse_args()
    torch.set_num_threads(a.threads)
    # AutoScheme's score cache: beside the token file (its key does not see the tokens, the directory does), so
    # the budgets of one bench run share one scoring, as ours share one measurement.
    cache = os.path.join(os.path.dirname(os.path.abspath(a.tokens)), "autoscheme_cache")
    os.environ["AR_AUTO_SCHEME_CACHE"] = cache
    cached = os.path.isdir(cache) and bool(os.listdir(cache))
    import auto_round
    import auto_round.calib_dataset
    import transformers
    from auto_round import AutoRound, AutoScheme
    from auto_round.auto_scheme import delta_loss
    from auto_round.auto_scheme.utils import compute_layer_bits

    calib, ev = torch.load(a.tokens), torch.load(a.eval)
    delta_loss.get_dataloader = token_loader(calib, a.batch_size)  # AutoScheme's scoring
    auto_round.calib_dataset.get_dataloader = token_loader(calib, a.batch_size)  # AutoRound's own calibration
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    before = {n: m.weight.detach().clone() for n, m in linears.items()}
    scheme = AutoScheme(avg_bits=a.avg_bits, options=a.options, nsamples=calib.shape[0], seqlen=calib.shape[1],
                        batch_size=a.batch_size, device_map="cpu", enable_torch_compile=False)
    search_s = []
    from auto_round.auto_scheme import gen_auto_scheme
    choose = gen_auto_scheme.GenScheme.get_layer_config

    def timed(self):  # the scheme search alone (scoring + DP), inside AutoRound's quantize()
        t0 = time.perf_counter()
        try:
            return choose(self)
        finally:
            search_s.append(time.perf_counter() - t0)
    gen_auto_scheme.GenScheme.get_layer_config = timed
    t = time.perf_counter()
    # dataset: a name only to pass AutoScheme's type check; the data come from token_loader.
    rounder = AutoRound(model, tok, scheme=scheme, iters=0, nsamples=calib.shape[0], seqlen=calib.shape[1],
                        dataset="NeelNanda/pile-10k", device_map="cpu", amp=False, enable_torch_compile=False,
                        disable_opt_rtn=not a.opt_rtn)
    rounder.quantize()
    seconds = time.perf_counter() - t
    quantized = rounder.model
    quantized.float()
    mods = dict(quantized.named_modules())
    layers, worst = {}, 0
    ours_total = theirs_total = numel = 0
    for n, w in before.items():
        m = mods[n]
        bits, group, sym = int(getattr(m, "bits", 16)), int(getattr(m, "group_size", 128)), bool(getattr(m, "sym", True))
        d, _ = distinct_per_group_of(m.weight.detach().float(), group)
        worst = max(worst, d / 2 ** bits)
        if bits < 16 and d > 2 ** bits:
            raise SystemExit(f"auto-round left {n} with {d} distinct values in a group of {group} (scheme {bits} bits): "
                             "weights are not quantized")
        theirs = compute_layer_bits(m)[0]
        ours = our_bits(w.numel(), tuple(w.shape), bits, group, sym) if bits < 16 else 16 * w.numel()
        layers[n] = {"bits": bits, "group_size": group, "sym": sym, "data_type": getattr(m, "data_type", None),
                     "distinct_max": d, "changed": not torch.equal(w, m.weight.detach().float()),
                     "ours_bits": ours, "autoround_bits": theirs}
        ours_total += ours
        theirs_total += theirs
        numel += w.numel()
    ppl = perplexity(quantized, ev)
    result = {"avg_bits": a.avg_bits, "options": a.options, "opt_rtn": a.opt_rtn, "seconds": seconds,
              "search_seconds": sum(search_s), "scores_cached": cached, "ppl": ppl,
              "bits_ours": ours_total / numel, "bits_autoround": theirs_total / numel, "numel": numel,
              "layers": layers, "nsamples": calib.shape[0], "seqlen": calib.shape[1], "batch_size": a.batch_size,
              "max_distinct_over_levels": worst,
              "versions": {"auto_round": auto_round.__version__, "transformers": transformers.__version__,
                           "torch": torch.__version__}}
    for path in (a.out, os.path.join(os.path.dirname(os.path.abspath(a.tokens)), f"autoscheme_{a.avg_bits}.json")):
        with open(path, "w") as f:  # a copy beside the tokens outlives the caller's temporary directory
            json.dump(result, f)
    counts = {}
    for v in layers.values():
        counts[v["bits"]] = counts.get(v["bits"], 0) + 1
    print(json.dumps({k: result[k] for k in ("avg_bits", "seconds", "search_seconds", "ppl", "bits_ours", "bits_autoround")}
                     | {"schemes": counts}))


def distinct_per_group_of(w: torch.Tensor, group: int) -> tuple[int, None]:
    """Largest number of distinct values in one group of ``group`` weights along in_features (the last group of a
    row the columns left over) of one weight."""
    worst = 0
    for start in range(0, w.shape[1], group if group > 0 else w.shape[1]):
        s = w[:, start:start + group].sort(dim=-1).values
        worst = max(worst, int((1 + (s.diff(dim=-1) != 0).sum(-1)).max()))
    return worst, None


if __name__ == "__main__":
    main()
