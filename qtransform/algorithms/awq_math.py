"""AWQ's scale search (Lin et al., 2024) as pure functions over a smoothing group.

For a :class:`~qtransform.algorithms.smoothing.SmoothGroup` whose linears read inputs of mean magnitude
``x̄`` per channel, the candidates are ``s_α = x̄^α`` for ``α = i / grid``, ``i < grid`` (``α = 0``: no
scaling), each divided by ``sqrt(max s · min s)``; with the weights' mean magnitude ``w̄`` (each group of
the weight divided by its largest magnitude, then averaged over rows: llm-compressor's "duo scaling")
``s_α = x̄^α / w̄^(1−α)``. A candidate is scored by running ``run(tensors)`` (a pure function giving the
outputs of the module the group feeds, on calibration inputs) with every quantized linear of the group
replaced by ``Q(W · diag(s)) · diag(1/s)``: the scaled layer as the unscaled input sees it. The score is
the squared error of those outputs against the float outputs; the first smallest wins, so ``α = 0`` keeps
a tie and the choice never does worse on the data than no scaling.

``Q`` is the weight's spec quantized through its format's codec with min/max ranges (``"rtn"``) or
HQQ's optimizer (``"hqq"``: the group parameters HQQ would fit to the scaled weight).

The candidates run one after the other, each a vectorized forward pass of the module over all the
sampled tokens: ``torch.func.vmap`` over the grid does the same arithmetic in ``grid`` times the memory
and was slower on CPU (CPU flash attention has no batching rule).

>>> import torch, qtransform as qt
>>> from qtransform.algorithms.smoothing import SmoothGroup
>>> g = torch.Generator().manual_seed(0)
>>> x = torch.randn(256, 16, generator=g); x[:, 2] *= 30  # one salient input channel
>>> params = {"n.weight": torch.ones(16), "fc.weight": torch.randn(8, 16, generator=g)}
>>> run = lambda t: [x @ t.get("fc.weight", params["fc.weight"]).T]
>>> choice = search_scales(run, params, SmoothGroup("n", ("fc",)), x.abs().mean(0),
...                        specs={"fc": qt.QuantSpec(format="uint3", granularity=qt.PerChannel(0), symmetric=False)})
>>> choice.alpha > 0 and bool(choice.errors[choice.index] < choice.errors[0])
True
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from .._checks import where
from ..observers import choose_qparams
from ..spec import QuantSpec
from ..tensor import blocks, fake_quantize
from .hqq_math import optimize as hqq_optimize
from .smoothing import (GroupShape, SmoothGroup, group_shape, logical_weight, member_transposed, quantized_linears,
                        to_input, weight_path)

__all__ = ["QUANTIZERS", "candidate_scales", "weight_mean", "input_mean", "quantize_weight", "scaled_weights",
           "ScaleChoice", "search_scales"]

#: How the search quantizes a candidate's weights.
QUANTIZERS = ("rtn", "hqq")


def candidate_scales(x_mean: torch.Tensor, grid: int = 20, *, w_mean: torch.Tensor | None = None
                     ) -> tuple[tuple[float, ...], torch.Tensor]:
    """The grid's ``α`` and their scales ``(grid, C)`` (float32; see the module docstring)."""
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise ValueError(f"awq: grid must be an int >= 1, got {grid!r}")
    grid_alphas = torch.arange(grid, dtype=torch.float64) / grid  # on the host: read as Python floats below
    alphas = grid_alphas.to(x_mean.device)[:, None]
    log_x = x_mean.detach().to(torch.float64).clamp(min=1e-4).log()
    log_s = alphas * log_x
    if w_mean is not None:
        log_s = log_s - (1 - alphas) * w_mean.detach().to(torch.float64).clamp(min=1e-4).log()
    log_s = log_s - (log_s.amax(-1, keepdim=True) + log_s.amin(-1, keepdim=True)) / 2  # / sqrt(max * min)
    return tuple(round(a, 12) for a in grid_alphas.tolist()), log_s.exp().to(torch.float32)


def input_mean(mean_abs: torch.Tensor, group: SmoothGroup, shape: GroupShape) -> torch.Tensor:
    """Mean ``|x|`` per input channel of the linears (``(channels,)``), averaged over the heads that read one
    producer channel (grouped-query attention) to the producer's channels (``(prev,)``)."""
    if shape.n_rep == 1:
        return mean_abs
    d = group.head_dim
    return mean_abs.reshape(shape.prev // d, shape.n_rep, d).mean(1).reshape(shape.prev)


def weight_mean(params: Mapping[str, torch.Tensor], group: SmoothGroup, specs: Mapping[str, QuantSpec | None],
                shape: GroupShape) -> torch.Tensor:
    """``w̄``: per producer channel, the mean over all the group's rows of ``|W|`` divided by the largest
    magnitude of its quantization block (whole rows for unquantized linears)."""
    cols = []
    for lin in quantized_linears(group):
        w = params[weight_path(group, lin)].detach().to(torch.float32)
        spec = specs.get(lin)
        a = w.abs()
        if spec is not None:
            p = blocks.tiling(w.shape, spec, path=weight_path(group, lin))
            amax = blocks.view(a, p).amax(dim=blocks.reduce_dims(p), keepdim=True)
            a = blocks.unview(blocks.view(a, p) / amax.clamp(min=1e-12), p)
        a = logical_weight(a, member_transposed(group, lin))
        if spec is None:
            a = a / a.amax(-1, keepdim=True).clamp(min=1e-12)
        cols.append(a.reshape(-1, a.shape[-1]))  # a stacked weight: every expert's rows
    m = torch.cat(cols).mean(0)
    return input_mean(m, group, shape)


def quantize_weight(w: torch.Tensor, spec: QuantSpec, quantizer: str = "rtn", *, path: str | None = None
                    ) -> torch.Tensor:
    """``w`` through ``spec``'s codec and back: min/max ranges (``"rtn"``) or HQQ's fitted parameters."""
    if quantizer == "hqq":
        return fake_quantize(w, hqq_optimize(w, spec, path=path))
    if quantizer != "rtn":
        raise ValueError(f"{where(path)}awq: quantizer must be one of {list(QUANTIZERS)}, got {quantizer!r}")
    return fake_quantize(w, choose_qparams(w, spec, path=path))


def scaled_weights(params: Mapping[str, torch.Tensor], group: SmoothGroup, s: torch.Tensor,
                   specs: Mapping[str, QuantSpec | None], quantizer: str = "rtn") -> dict[str, torch.Tensor]:
    """``{linear.weight: Q(W · diag(s)) · diag(1/s)}`` for the group's quantized linears (stored layout and
    dtype); ``s`` has the linears' input channels."""
    out = {}
    for lin in quantized_linears(group):
        spec = specs.get(lin)
        if spec is None:
            continue
        path = weight_path(group, lin)
        w = params[path]
        f = (s[:, None] if member_transposed(group, lin) else s[None, :]).to(device=w.device, dtype=torch.float32)
        q = quantize_weight(w.detach().to(torch.float32) * f, spec, quantizer, path=path)
        out[path] = (q / f).to(w.dtype)
    return out


class ScaleChoice(NamedTuple):
    """What :func:`search_scales` chose: ``index`` into ``alphas``/``errors`` (``0``: no scaling), ``alpha``,
    the producer-channel ``scales`` ``(prev,)``, and every candidate's ``errors`` (float64)."""

    index: int
    alpha: float
    scales: torch.Tensor
    alphas: tuple[float, ...]
    errors: torch.Tensor


def _first(out) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"awq: the inspected module returned {type(out).__name__}, not a tensor (or a tuple "
                        "starting with one)")
    return out


def _outputs(run: Callable, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    return [_first(o).to(torch.float32) for o in run(tensors)]


def search_scales(run: Callable[[Mapping[str, torch.Tensor]], Sequence], params: Mapping[str, torch.Tensor],
                  group, x_mean: torch.Tensor, *, specs: Mapping[str, QuantSpec | None], grid: int = 20,
                  duo_scaling: bool = False, quantizer: str = "rtn", reduce: Callable | None = None,
                  part: tuple[int, int] | None = None) -> ScaleChoice:
    """Search ``group``'s scales (see the module docstring).

    Args:
        run: ``run(tensors) -> outputs``: the inspected module on the calibration inputs, its tensors taken
            from ``tensors`` where given (``{path: tensor}``), from ``params`` otherwise.
        params: flat tree holding the group's tensors (not modified).
        group: a :class:`SmoothGroup` or its dict.
        x_mean: mean ``|x|`` per input channel of the group's linears ``(channels,)``.
        specs: ``{linear module path: spec of its stored weight}`` (missing or ``None``: not quantized).
        grid: number of ``α`` (``i / grid``, ``i < grid``).
        duo_scaling: divide by the weights' mean magnitude to the power ``1 − α``.
        quantizer: ``"rtn"`` or ``"hqq"``.
        reduce: ``reduce(errors) -> errors``, the candidates' output errors (float64, ``(grid,)``) summed over
            the processes that ran ``run`` on their shares of the inputs (``Parallel.all_sum``; ``None``: one).
        part: ``(rank, world)`` when every process runs ``run`` on the same inputs: this one scores only the
            candidates ``i`` with ``i % world == rank`` (the others' errors are 0 here) and ``reduce`` sums
            the processes' errors, so each candidate is scored once, on one process, as in one process.
    """
    group = SmoothGroup.from_value(group)
    shape = group_shape(params, group)
    if not isinstance(x_mean, torch.Tensor) or tuple(x_mean.shape) != (shape.channels,):
        got = tuple(x_mean.shape) if isinstance(x_mean, torch.Tensor) else type(x_mean).__name__
        raise ValueError(f"awq: group of {group.prev!r}: input means of shape {got}, its linears read "
                         f"{shape.channels} channels")
    if not any(specs.get(lin) is not None for lin in quantized_linears(group)):
        raise ValueError(f"awq: group of {group.prev!r}: none of its linears {list(group.linears)} is quantized")
    w_mean = weight_mean(params, group, specs, shape) if duo_scaling else None
    alphas, cands = candidate_scales(input_mean(x_mean.float(), group, shape), grid, w_mean=w_mean)
    with torch.no_grad():
        ref = _outputs(run, {})
        errors = []
        for i, s in enumerate(cands):
            if part is not None and i % part[1] != part[0]:
                errors.append(torch.zeros((), dtype=torch.float64, device=x_mean.device))
                continue
            outs = _outputs(run, scaled_weights(params, group, to_input(s, group, shape), specs, quantizer))
            errors.append(sum((o - r).double().pow(2).sum() for o, r in zip(outs, ref)))
    errors = torch.stack(errors)
    if reduce is not None:
        errors = reduce(errors)
    finite = torch.isfinite(errors)
    if not bool(finite.any()):
        raise ValueError(f"awq: group of {group.prev!r}: every candidate gave a non-finite output error")
    best = int(torch.argmin(torch.where(finite, errors, torch.inf)))
    return ScaleChoice(best, alphas[best], cands[best], alphas, errors)
