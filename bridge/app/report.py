"""What quantization did to a model: per-layer error, sizes, bits per weight, perplexity.

``layer_rows(params, qtree, plan)`` measures every quantized tensor against the original
(relative error ``||W - Ŵ||² / ||W||²``); :class:`Report` collects them with the model
sizes, timings and perplexities, renders a text table, a JSON dict and a PNG plot.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

import torch

import qtransform as qt

from ..step_outputs import SLOTS

__all__ = ["LayerRow", "Report", "layer_rows", "layer_row", "peak_memory", "tree_bytes", "format_bytes", "steps_label", "table"]


@dataclasses.dataclass(frozen=True)
class LayerRow:
    path: str
    spec: str
    shape: tuple[int, ...]
    bytes: int
    bits_per_weight: float
    rel_error: float | None  # None: not measured (a streamed run without --layer-errors)
    rule: str
    bytes_before: int  # the original tensor's


def _rel_error(w: torch.Tensor, q: qt.QTensor) -> float:
    """``||W - Ŵ||² / ||W||²`` in two dot products over one dequantized copy (no other temporary)."""
    w = w.detach().to(torch.float32).reshape(-1)
    d = qt.dequantize(q, dtype=torch.float32).reshape(-1).sub_(w)
    return float(torch.dot(d, d) / torch.dot(w, w).clamp(min=torch.finfo(torch.float32).tiny))


def layer_rows(params: Mapping[str, torch.Tensor], qtree: Mapping[str, Any], plan: Mapping, *, error: bool = True,
               dtypes: Mapping[str, torch.dtype] | None = None) -> list[LayerRow]:
    """One row per quantized tensor (dequantized one at a time: memory stays one layer); ``dtypes``: the
    dtypes the float tensors are stored in (their bytes before), else as loaded."""
    rows = []
    for path, q in qtree.items():
        if isinstance(q, qt.QTensor):
            rows.append(layer_row(path, params[path], q, plan[path].rule if path in plan else "", error=error,
                                  stored=(dtypes or {}).get(path)))
    return rows


def peak_memory() -> int:
    """Peak resident memory of this process so far, in bytes (``getrusage``; 0 where unavailable)."""
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):  # pragma: no cover  (Windows)
        return 0


def layer_row(path: str, w: torch.Tensor, q: qt.QTensor, rule: str, *, error: bool = True,
              stored: torch.dtype | None = None) -> LayerRow:
    """The row of one quantized tensor ``q`` of float ``w`` (its relative error measured with ``error``; its
    bytes before in the ``stored`` dtype, else in ``w``'s)."""
    return LayerRow(path, str(q.spec), tuple(q.shape), q.nbytes(), q.bits_per_element(),
                    _rel_error(w, q) if error else None, rule,
                    w.numel() * (stored or w.dtype).itemsize)


def tree_bytes(tree: Mapping[str, Any], dtypes: Mapping[str, torch.dtype] | None = None) -> int:
    """Bytes held by a (possibly quantized) flat tree, counting shared tensors once; a float tensor whose path
    ``dtypes`` names counts in that dtype (the one it is stored in)."""
    seen, total = set(), 0
    for path, v in tree.items():
        if isinstance(v, qt.QTensor):
            total += v.nbytes()
        elif isinstance(v, torch.Tensor):
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
            if key not in seen:
                seen.add(key)
                total += v.numel() * (dtypes or {}).get(path, v.dtype).itemsize
    return total


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def steps_label(steps) -> str:
    """``"hqq (error_norm=4.0) -> rtn"``: a recipe's steps with their options, for people
    (``Step`` objects or their dicts; none is round to nearest)."""
    if not steps:
        return "round to nearest"
    out = []
    for s in steps:
        name, options = (s["name"], s.get("options", {})) if isinstance(s, dict) else (s.name, s.options)
        opts = ", ".join(f"{k}={v}" for k, v in dict(options).items())
        out.append(f"{name} ({opts})" if opts else name)
    return " -> ".join(out)


@dataclasses.dataclass
class Report:
    model: str
    recipe: str
    steps: list[dict]
    layers: list[LayerRow]
    size_before: int
    size_after: int
    seconds_quantize: float
    seconds_total: float = 0.0
    ppl_before: float | None = None
    ppl_after: float | None = None
    eval_tokens: int = 0
    out: str = ""
    unmatched: list[str] = dataclasses.field(default_factory=list)
    calib_tokens: int = 0
    activations: list[dict] = dataclasses.field(default_factory=list)
    step_info: dict = dataclasses.field(default_factory=dict)
    online: list[dict] = dataclasses.field(default_factory=list)
    peak_memory: int = 0
    streamed: str = ""  # how a streamed run went: "shard to shard" or "block by block"; "" in memory
    driver: str = ""  # the driver and why it was chosen: "streamed block by block (the default for ...)"
    notes: list[str] = dataclasses.field(default_factory=list)  # what the run left out on purpose, and why
    outputs: dict = dataclasses.field(default_factory=dict)  # {kind: record} of the step outputs (bridge.step_outputs)
    output_bytes: dict = dataclasses.field(default_factory=dict)  # {kind: bytes} of their tensors (in size_after)
    phases: dict = dataclasses.field(default_factory=dict)  # {phase: seconds} of the command, in order
    training: dict = dataclasses.field(default_factory=dict)  # qtransform train's record (bridge.app.train_report)
    task: str = "causal-lm"  # what the model was quantized for (bridge.app.tasks), and how that was chosen
    task_chosen: str = ""
    quality: dict = dataclasses.field(default_factory=dict)  # a non-LM task's measures (bridge.app.task_eval)

    @property
    def quantized_numel(self) -> int:
        return sum(math.prod(r.shape) for r in self.layers)

    @property
    def bits_per_weight(self) -> float:
        n = self.quantized_numel
        return 8.0 * sum(r.bytes for r in self.layers) / n if n else float("nan")

    @property
    def bits_per_weight_before(self) -> float:
        n = self.quantized_numel
        return 8.0 * sum(r.bytes_before for r in self.layers) / n if n else float("nan")

    def worst(self, n: int = 5) -> list[LayerRow]:
        return sorted((r for r in self.layers if r.rel_error is not None), key=lambda r: r.rel_error, reverse=True)[:n]

    @property
    def measured(self) -> bool:
        """Whether the layers' relative errors were measured."""
        return any(r.rel_error is not None for r in self.layers)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        outputs, nbytes = d.pop("outputs"), d.pop("output_bytes")
        for kind in {**dict.fromkeys(SLOTS), **outputs}:  # each kind: "<kind>" (its record), "<kind>_bytes"
            d[kind], d[f"{kind}_bytes"] = outputs.get(kind, {}), nbytes.get(kind, 0)
        d["layers"] = [dataclasses.asdict(r) | {"shape": list(r.shape)} for r in self.layers]
        d["quantized_numel"] = self.quantized_numel
        d["bits_per_weight"] = self.bits_per_weight
        d["bits_per_weight_before"] = self.bits_per_weight_before
        d["mean_rel_error"] = (sum(r.rel_error for r in self.layers) / len(self.layers)) if self.measured else None
        return d

    def render(self) -> str:
        lines = [f"qtransform report — {self.model}",
                 f"recipe {self.recipe} ({steps_label(self.steps)}"
                 + (f", calibrated on {self.calib_tokens} tokens" if self.calib_tokens else "") + "); "
                 f"{len(self.layers)} tensors quantized, "
                 f"{self.quantized_numel / 1e6:.1f}M weights"]
        by_spec: dict[str, list[LayerRow]] = {}
        for r in self.layers:
            by_spec.setdefault(r.spec, []).append(r)
        rows = [["spec", "tensors", "weights", "bits/weight", "mean rel. error", "max rel. error"]]
        for spec, rs in by_spec.items():
            n = sum(math.prod(r.shape) for r in rs)
            errors = [f"{sum(r.rel_error for r in rs) / len(rs):.5f}", f"{max(r.rel_error for r in rs):.5f}"] \
                if self.measured else ["-", "-"]
            rows.append([spec, str(len(rs)), f"{n / 1e6:.2f}M", f"{8 * sum(r.bytes for r in rs) / n:.3f}", *errors])
        lines += ["", *table(rows)]
        if self.measured:
            lines += ["", "worst layers (relative error ||W - Ŵ||² / ||W||²):"]
            lines += table([["tensor", "spec", "rel. error"]] +
                           [[r.path, r.spec, f"{r.rel_error:.5f}"] for r in self.worst()])
        else:
            lines += ["", "per-layer errors not measured (--no-layer-errors)"]
        if self.activations:
            static = [a for a in self.activations if not a["dynamic"]]
            lines += ["", f"activations: {len(self.activations)} quantized "
                      f"({len(static)} static, {len(self.activations) - len(static)} dynamic)"
                      + ("; widest static ranges:" if static else "")]
            widest = sorted(static, key=lambda a: a["range"][1] - a["range"][0], reverse=True)[:5]
            lines += table([["site", "spec", "range"]] + [[f"{a['module']} ({a['role']})", a["spec"],
                                                           f"[{a['range'][0]:.4g}, {a['range'][1]:.4g}]"]
                                                          for a in widest]) if widest else []
        if self.online:
            lines += ["", "online rotations: " + "; ".join(online_summary(self.online))]
        for kind, record in self.outputs.items():
            n = self.output_bytes.get(kind, 0)
            extra = 8 * n / self.quantized_numel if self.quantized_numel else float("nan")
            lines += ["", f"{SLOTS[kind].summary(record)}, {format_bytes(n)} (+{extra:.3f} bits per quantized weight)"]
        lines += step_info_lines(self.step_info)
        if self.training:
            from .train_report import training_lines
            lines += training_lines(self.training)
        ratio = self.size_before / self.size_after if self.size_after else float("nan")
        summary = [["", "before", "after"],
                   ["model size", format_bytes(self.size_before), f"{format_bytes(self.size_after)} ({ratio:.2f}x smaller)"],
                   ["bits per quantized weight", f"{self.bits_per_weight_before:.0f}" if self.layers else "-",
                    f"{self.bits_per_weight:.3f}"]]
        if self.ppl_before is not None or self.ppl_after is not None:
            fmt = lambda p: "-" if p is None else f"{p:.3f}"  # noqa: E731
            summary.append([f"perplexity ({self.eval_tokens} tokens)", fmt(self.ppl_before), fmt(self.ppl_after)])
        if self.quality:
            from .task_eval import quality_rows
            summary += quality_rows(self.quality)
        main = "train" if self.training else "quantize"  # the phase seconds_quantize measured
        summary.append(["wall time", "", f"{main} {self.seconds_quantize:.1f} s, total {self.seconds_total:.1f} s"])
        others = [f"{k} {v:.1f} s" for k, v in self.phases.items() if k != main and v >= 0.05]
        if others:
            summary.append(["", "", ", ".join(others)])
        if self.peak_memory:
            summary.append(["peak host memory", "", format_bytes(self.peak_memory)
                            + (f" (streamed: {self.streamed})" if self.streamed else " (in memory)")])
        lines += ["", *table(summary)]
        if self.driver:
            lines += ["", f"driver: {self.driver}"]
        if self.task != "causal-lm" or self.task_chosen == "--task":
            lines += [f"task: {self.task} ({self.task_chosen})"]
        lines += [f"note: {n}" for n in self.notes]
        if self.unmatched:
            lines += ["", "warning: recipe patterns that matched nothing: " + ", ".join(self.unmatched)]
        if self.out:
            lines += ["", f"checkpoint, report.json and plots: {self.out}"]
        return "\n".join(lines)

    def plot(self, path: str | Path) -> None:
        """PNG: per-layer relative error and the size breakdown (and a training run's loss curve)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        widths = [3, 1, 2] if self.training else [3, 1]
        fig, axes = plt.subplots(1, len(widths), figsize=(13 + 5 * (len(widths) - 2), 4.5),
                                 gridspec_kw={"width_ratios": widths})
        ax1, ax2 = axes[:2]
        if self.training:
            from .train_report import plot_loss
            plot_loss(axes[2], self.training)
        by_kind: dict[str, list[int]] = {}  # module name without its parents: q_proj, up_proj...
        for i, r in enumerate(self.layers):
            by_kind.setdefault(r.path.rsplit(".", 2)[-2] if r.path.count(".") >= 2 else r.path, []).append(i)
        for kind, idx in sorted(by_kind.items()):
            ax1.scatter(idx, [self.layers[i].rel_error or float("nan") for i in idx], s=10, label=kind)
        ax1.set_yscale("log")
        ax1.set_xlabel("quantized tensor (model order)")
        ax1.set_ylabel("relative error ||W - Ŵ||² / ||W||²")
        ax1.set_title(f"{self.recipe}: per-layer error")
        ax1.legend(fontsize=7, ncol=2)
        quant = sum(r.bytes for r in self.layers)
        other = self.size_after - quant
        ax2.bar(["before", "after"], [self.size_before / 2**20, 0], color="tab:gray", label="full precision")
        ax2.bar(["after"], [other / 2**20], color="tab:gray")
        ax2.bar(["after"], [quant / 2**20], bottom=[other / 2**20], color="tab:blue", label="quantized")
        ax2.set_ylabel("MiB")
        ax2.set_title(f"size: {self.bits_per_weight:.2f} bits/weight")
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def online_rows(online: Mapping) -> list[dict]:
    """``[{"module", "role", "kind", "size"}]`` of the online rotations ``{Site: OnlineRotation}``."""
    return [{"module": s.module, "role": s.role, **rot.to_dict()} for s, rot in online.items()]


def online_summary(rows) -> list[str]:
    """``"<count> <role> <kind> <size>"`` per kind of online rotation (rows of :func:`online_rows`)."""
    counts: dict[tuple, int] = {}
    for r in rows:
        key = ("input" if r["role"] == "input" else "query/key", r["kind"], r["size"])
        counts[key] = counts.get(key, 0) + 1
    return [f"{n} {role} {kind} {size}" for (role, kind, size), n in counts.items()]


def activation_rows(activations: Mapping) -> list[dict]:
    """One row per activation quantizer: site, spec, dynamic, and for static ones the range the
    calibrated parameters represent (what the largest codes dequantize to)."""
    rows = []
    for site, q in activations.items():
        spec = q if isinstance(q, qt.QuantSpec) else q.spec
        row = {"module": site.module, "role": site.role, "spec": str(spec), "dynamic": bool(spec.dynamic)}
        if isinstance(q, qt.QParams):
            width = q.scale.shape[-1] if q.scale.dim() else 1
            x = torch.tensor([-3e38, 3e38]).reshape(2, 1).expand(2, width)
            if q.scale.dim() > 2:  # e.g. per head of the key/value cache: (1, heads, 1, 1)
                x = torch.tensor([-3e38, 3e38]).reshape((2,) + (1,) * (q.scale.dim() - 1)).expand(2, *q.scale.shape[1:])
            y = qt.fake_quantize(x, q)
            row["range"] = [float(y.min()), float(y.max())]
        rows.append(row)
    return rows


def table(rows: list[list[str]]) -> list[str]:
    """Plain-text lines of a table whose first row is the header (columns padded to fit)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(rows[0], widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows[1:]]
    return out


def experts_lines(values: dict) -> list[str]:
    """Per stacked experts weight: its experts' calibration tokens (fewest, most, each in report.json) and which
    experts fell back to a data-free fit."""
    rows = [["tensor", "experts", "tokens min", "tokens max", "fell back"]]
    for path, v in values.items():
        tokens = v.get("tokens", [])
        fell = "; ".join(f"{how}: {es}" for how, es in sorted(v.get("fallback", {}).items())) or "-"
        rows.append([path, str(len(tokens)), str(min(tokens, default=0)), str(max(tokens, default=0)), fell])
    return ["", f"experts: {len(values)} stacked weights, each expert fitted from the tokens routed to it"] + table(rows)


def step_info_lines(info: dict, n: int = 5) -> list[str]:
    """What the steps reported per tensor (``Fit.info``): for each numeric name, the ``n`` largest
    values (GPTQ's layer losses); for other values, how many tensors got each."""
    by_name: dict[str, dict] = {}
    for path, values in info.items():
        for name, v in values.items():
            by_name.setdefault(name, {})[path] = v
    lines = []
    for name, values in sorted(by_name.items()):
        if name == "experts":
            lines += experts_lines(values)
            continue
        numbers = {p: v for p, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if len(numbers) == len(values):
            top = sorted(numbers.items(), key=lambda kv: kv[1], reverse=True)[:n]
            lines += ["", f"{name}: {len(values)} tensors, total {sum(numbers.values()):.6g}; largest:"]
            lines += table([["tensor", name]] + [[p, f"{v:.6g}"] for p, v in top])
        else:
            counts: dict[str, int] = {}
            for v in values.values():
                counts[str(v)] = counts.get(str(v), 0) + 1
            lines += ["", f"{name}: " + ", ".join(f"{k} ({c})" for k, c in sorted(counts.items()))]
    return lines
