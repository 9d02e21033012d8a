"""``qtransform search``: each linear layer's scheme chosen under a size budget, written as a recipe file.

    qtransform search [--model DIR] --budget BITS [--candidates A,B,...] [--algorithm rtn|hqq|gptq]
                      [--estimate fisher|hessian [--fisher-tokens N]] [--calib N]
                      [--pin GLOB=SCHEME ...] [--to TARGET] [--reference kl [--reference-layers N]]
                      --out recipe.toml|recipe.json [--plot FILE.png] [--json FILE]

The model runs once on ``--calib`` sequences of the corpus's calibration part, folding the input Hessian of
every linear (:func:`bridge.search.measure`) and, with ``--estimate fisher`` (the default), runs backward on
``--fisher-tokens`` of those positions (batches spread over the calibration) for the Fisher diagonal of its
output distribution with respect to every linear's outputs; each layer
is scored under each candidate by its output error weighted by half that Fisher (the second-order estimate of
the KL divergence of the model's output, in nats, one scale across layers; ``hessian``: unweighted); the
multiple-choice knapsack (:func:`qtransform.search.search`, exact) picks the least total error within
``--budget`` bits per weight of the searched weights (scales and zero points counted; ``lm_head`` and the
embeddings are not searched and stay as they are). Linears that read one input (q/k/v, gate/up) share a
scheme, ``--pin`` fixes layers, ``--to`` keeps only the schemes that target holds exactly
(``compressed-tensors``: also only 4- and 8-bit integers, what vLLM's kernels load). ``--reference kl``
measures, for ``--reference-layers`` layers spread over the model and every candidate, the KL divergence
of the output on held-out tokens with that layer alone quantized, and reports the rank correlation of the
estimate with it.

Everything is checked before the model loads; the recipe, the plot and the JSON report are written at the
end, each under a temporary name renamed into place.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path

from . import inputs, outputs
from .inputs import UserError
from .outputs import say

__all__ = ["add_parser", "cmd_search"]


def add_parser(sub, at_least):
    from qtransform.search import DEFAULT_CANDIDATES, SEARCH_ALGORITHMS

    from ..search import ESTIMATES, FISHER_TOKENS

    s = sub.add_parser("search", help="choose each layer's format, width and group under a size budget; write the recipe")
    s.add_argument("--model", help="transformers directory (default: SmolLM2-135M-Instruct)")
    s.add_argument("--budget", type=float, required=True, metavar="BITS",
                   help="bits per weight of the searched linear weights, scales and zero points counted")
    s.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES), metavar="A,B,...",
                   help=f"candidate schemes (default {','.join(DEFAULT_CANDIDATES)})")
    s.add_argument("--algorithm", default="rtn", choices=SEARCH_ALGORITHMS,
                   help="how each candidate quantizes a weight, scored and written as the recipe's step (default rtn)")
    s.add_argument("--estimate", default="fisher", choices=ESTIMATES,
                   help="fisher: each layer's output error weighted by the Fisher of the model's output, an estimate "
                        "of the KL (default); hessian: the output error alone (no backward pass)")
    s.add_argument("--fisher-tokens", type=at_least(1), default=FISHER_TOKENS, metavar="N",
                   help=f"calibration positions the Fisher is taken on (default {FISHER_TOKENS}; more: less noise, "
                        "one forward+backward per batch)")
    s.add_argument("--calib", type=at_least(1), default=16, metavar="N", help="calibration sequences (default 16)")
    s.add_argument("--calib-batch", type=at_least(1), default=4, metavar="B", help="calibration sequences per forward pass")
    s.add_argument("--pin", action="append", default=[], metavar="GLOB=SCHEME",
                   help="layers matching GLOB take SCHEME (repeatable; first match wins)")
    s.add_argument("--to", metavar="TARGET", help="only schemes this export target holds exactly (compressed-tensors...)")
    s.add_argument("--reference", choices=("kl",), help="also measure the KL reference on a subset of layers")
    s.add_argument("--reference-layers", type=at_least(2), default=6, metavar="N",
                   help="layers of the KL reference, spread over the model (default 6)")
    s.add_argument("--reference-sequences", type=at_least(1), default=2, metavar="N",
                   help="held-out sequences (evaluation part) of the KL reference (default 2)")
    s.add_argument("--out", required=True, help="the recipe file to write (.toml with comments, or .json)")
    s.add_argument("--plot", metavar="FILE.png", help="the Pareto front of estimated loss against size (needs matplotlib)")
    s.add_argument("--json", metavar="FILE", help="also write the search's report as JSON")
    s.add_argument("--corpus", default="builtin", help="'builtin', a text file, or hf:NAME[/CONFIG]")
    s.add_argument("--seq-len", type=at_least(2), default=512, help="tokens per sequence")
    s.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    return s


def _pins(values, by_name):
    from qtransform import search as qsearch

    pins = {}
    for v in values:
        glob, eq, name = v.partition("=")
        if not eq or not glob or not name:
            raise UserError(f"--pin {v!r}: expected GLOB=SCHEME (model.layers.0.*=int8)")
        try:
            by_name.get(name) or qsearch.candidate(name)
        except ValueError as e:
            raise UserError(f"--pin {v}: {str(e).removeprefix('candidates: ')}") from None
        pins[glob] = name
    return pins


def _allowed(target):
    """``spec -> bool``: the target holds it exactly (compressed-tensors: integers only at 4 and 8 bits)."""
    from .. import interop

    if target is None:
        return None
    if target not in interop.EXPORTERS:
        raise UserError(f"--to {target!r}: unknown target; targets: {', '.join(sorted(interop.EXPORTERS))}")
    exporter = interop.EXPORTERS[target]

    def allowed(spec) -> bool:
        if exporter.support(spec).kind != "exact":
            return False
        return target != "compressed-tensors" or spec.fmt.family != "int" or spec.fmt.codec.bits in (4, 8)
    return allowed


def _checked(a):
    """Everything checkable before loading: ``(candidates, pins, allowed, out)``."""
    from qtransform import search as qsearch

    if not (0 < a.budget < math.inf):
        raise UserError(f"--budget must be a positive number of bits per weight, got {a.budget}")
    try:
        cands = qsearch.candidates(a.candidates)
    except ValueError as e:
        raise UserError(f"--{e}") from None
    by_name = {c.name: c for c in cands}
    pins = _pins(a.pin, by_name)
    allowed = _allowed(a.to)
    if allowed is not None:
        for glob, name in pins.items():
            spec = (by_name.get(name) or qsearch.candidate(name)).spec
            if not allowed(spec):
                raise UserError(f"--pin {glob}={name}: --to {a.to} cannot hold {spec} exactly")
        if not any(allowed(c.spec) for c in cands):
            raise UserError(f"--candidates: --to {a.to} holds none of {[c.name for c in cands]} exactly")
    out = Path(a.out)
    if out.suffix.lower() not in (".toml", ".json"):
        raise UserError(f"--out {out}: a recipe file ends in .toml or .json")
    outputs.check_file_target(out, option="--out")
    if a.plot:
        if importlib.util.find_spec("matplotlib") is None:
            raise UserError("--plot needs matplotlib: pip install matplotlib")
        outputs.check_file_target(Path(a.plot), option="--plot")
    if a.json:
        outputs.check_file_target(Path(a.json), option="--json")
    return cands, pins, allowed, out


def _user_error(e: ValueError) -> UserError:
    text = str(e)
    for name in ("budget", "pin", "candidates"):
        if text.startswith(name):
            return UserError(f"--{text}")
    return UserError(text)


def _feasible(model, a, cands, pins, allowed) -> None:
    """The search solved with every loss 0: a budget below the smallest size, a pin matching nothing, a layer no
    allowed candidate takes fail here, before any measurement."""
    from qtransform import search as qsearch

    from .. import search as bsearch

    try:
        layers, groups = bsearch.searched_layers(model)
        qsearch.search(layers, cands, {p: dict.fromkeys((c.name for c in cands), 0.0) for p in layers},
                       budget=a.budget, groups=groups, pins=pins, allowed=allowed)
    except ValueError as e:
        raise _user_error(e) from None


def cmd_search(a) -> int:
    from qtransform import search as qsearch

    from .. import search as bsearch
    from . import models

    t0 = time.perf_counter()
    cands, pins, allowed, out = _checked(a)
    calib_text = inputs.corpus_text(a.corpus, part="calibration")
    eval_text = inputs.corpus_text(a.corpus) if a.reference else None
    source = inputs.model_source(a.model)
    skeleton = inputs.skeleton(source)
    if skeleton is not None:  # budget, pins and target against the shapes of config.json, before loading
        _feasible(skeleton, a, cands, pins, allowed)
        inputs.check_seq_len(skeleton, a.seq_len)
        del skeleton
    say(f"loading {a.model or models.DEFAULT_MODEL} ...")
    model, tokenizer = inputs.model_and_tokenizer(a.model, source=source, dequantize_imported=True)
    inputs.check_seq_len(model, a.seq_len)
    _feasible(model, a, cands, pins, allowed)
    calibration = inputs.calibration(a, tokenizer, calib_text)
    say(f"measuring {len(cands)} candidates ({a.algorithm}) on {a.calib} calibration sequences ...")
    try:
        sens = bsearch.measure(model, calibration, cands, algorithm=a.algorithm, estimate=a.estimate,
                               fisher_tokens=a.fisher_tokens, progress=outputs.progress_bar())
        result = qsearch.search(sens.layers, cands, sens.losses, budget=a.budget, groups=sens.groups, pins=pins,
                                allowed=allowed)
    except ValueError as e:
        raise _user_error(e) from None
    ref = None
    if a.reference:
        held_out = inputs.sequences(tokenizer, eval_text, a.corpus, a.seq_len, a.reference_sequences)
        pairs = bsearch.spread_pairs(sens.losses, a.reference_layers)
        say(f"KL reference: {len(pairs)} (layer, candidate) pairs on {held_out.numel()} held-out tokens ...")
        ref = bsearch.kl_reference(model, list(held_out.split(1)), cands, pairs, sens.losses, algorithm=a.algorithm,
                                   hessians=sens.hessians, progress=outputs.progress_bar())
    seconds = time.perf_counter() - t0
    numel = sum(math.prod(s) for s in sens.layers.values())
    notes = [f"model {a.model or models.DEFAULT_MODEL}; candidates {a.candidates}; {a.calib} calibration sequences of "
             f"{a.seq_len} tokens; estimate {_ESTIMATE[a.estimate]} with {a.algorithm}"
             + (f" (Fisher on {a.fisher_tokens} positions)" if a.estimate == "fisher" else ""),
             f"use: qtransform quantize --recipe {out.name}" + (f" --calib {a.calib}" if a.algorithm == "gptq" else "")]
    notes += [f"pin {g}={n}" for g, n in pins.items()] + ([f"target {a.to}"] if a.to else [])
    steps = (a.algorithm,)
    text = (qsearch.recipe_toml(result, steps=steps, notes=notes) if out.suffix.lower() == ".toml"
            else qsearch.recipe_json(result, steps=steps))
    report = _report(a, result, sens, ref, numel, seconds)
    if a.plot:
        _plot(Path(a.plot), result, numel, a.budget, a.estimate)
    if a.json:
        outputs.write_text(Path(a.json), json.dumps(report, indent=2) + "\n", option="--json")
    outputs.write_text(out, text, option="--out")
    say(_render(report, out))
    return 0


#: How each estimate is written in the recipe's notes.
_ESTIMATE = {"fisher": "KL ~ sum_j F_j/2 (E H E^T)_jj", "hessian": "tr(E H E^T)"}


def _report(a, result, sens, ref, numel, seconds) -> dict:
    counts = {}
    for name in result.choice.values():
        counts[name] = counts.get(name, 0) + 1
    return {
        "model": a.model, "budget_bits": a.budget, "budget_bytes": result.budget, "bytes": result.size,
        "bits_per_weight": result.bits_per_weight, "weights": numel, "estimated_loss": result.loss,
        "exact": result.exact, "lower_bound": result.bound, "algorithm": a.algorithm, "estimate": a.estimate,
        "fisher_tokens": a.fisher_tokens if a.estimate == "fisher" else None,
        "layers": len(result.choice), "schemes": counts,
        "uniform": {n: {"bytes": s, "bits_per_weight": 8 * s / numel, "estimated_loss": l}
                    for n, (s, l) in result.uniform.items()},
        "choice": result.choice, "skipped": sens.skipped,
        "seconds_measure": sens.seconds, "seconds_total": seconds,
        "front": [[s, l] for s, l in result.front],
        **({"reference": {"spearman": ref.spearman, "pairs": len(ref.kl), "tokens": ref.tokens,
                          "kl": [[p, c, v, ref.estimate[(p, c)]] for (p, c), v in ref.kl.items()]}} if ref else {}),
    }


def _render(r: dict, out: Path) -> str:
    lines = [f"searched {r['layers']} layers: {r['bytes']} bytes = {r['bits_per_weight']:.4f} bits per weight "
             f"(budget {r['budget_bits']}), estimated loss {r['estimated_loss']:.4g}"
             + ("" if r["exact"] else f" (rounded-size knapsack; the optimum is >= {r['lower_bound']:.4g})"),
             "schemes: " + ", ".join(f"{n} x{k}" for n, k in sorted(r["schemes"].items())),
             "uniform schemes (bits per weight, estimated loss):"]
    for n, u in sorted(r["uniform"].items(), key=lambda kv: kv[1]["bytes"]):
        lines.append(f"  {n:<12} {u['bits_per_weight']:7.4f}  {u['estimated_loss']:.4g}")
    if "reference" in r:
        lines.append(f"KL reference: Spearman {r['reference']['spearman']:.3f} over {r['reference']['pairs']} pairs")
    lines.append(f"wrote {out} in {r['seconds_total']:.1f} s")
    return "\n".join(lines)


def _plot(path: Path, result, numel: int, budget: float, result_estimate: str = "fisher") -> None:
    """PNG, written under a temporary name then renamed: the front, the uniform schemes, the answer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [8 * s / numel for s, _ in result.front]
    ax.step(xs, [l for _, l in result.front], where="post", label="searched (Pareto front)")
    for name, (s, l) in result.uniform.items():
        ax.scatter([8 * s / numel], [l], marker="x", color="tab:red")
        ax.annotate(name, (8 * s / numel, l), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.scatter([result.bits_per_weight], [result.loss], color="tab:green", zorder=3, label=f"chosen at {budget} bits")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (scales and zero points counted)")
    ax.set_ylabel("estimated KL (nats per token)" if result_estimate == "fisher" else "estimated loss  Σ tr(E H Eᵀ)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"--plot {path}: cannot write it ({e.strerror or e})") from None
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
