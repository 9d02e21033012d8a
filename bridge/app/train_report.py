"""What ``qtransform train`` adds to the run's report (:class:`bridge.app.report.Report`'s ``training``): the
training's record (steps, tokens, learning rates, the loss of every step), its lines in the printed report, its
loss curve in ``report.png``, and how far each quantized tensor's float weight moved.

>>> rec = {"steps": 4, "batch": 2, "seq_len": 8, "tokens": 64, "budget": 60, "sequences": 10, "lr": 1e-5,
...        "range_lr": 1e-4, "weight_decay": 0.0, "ranges_only": False, "distill": False, "temperature": None,
...        "seed": 0, "schedule": "cosine", "warmup": 1, "resumed_at": None, "seconds": 1.0,
...        "loss": [4.0, 3.0, 2.0, 1.0]}
>>> print("\\n".join(training_lines(rec)))
<BLANKLINE>
training: 4 steps x 2 x 8 tokens = 64 tokens (budget 60) on 10 sequences; AdamW lr 1e-05, ranges 0.0001; 1 warm-up
steps, then cosine
loss: 4.0000 (mean of the first 1 steps) -> 1.0000 (mean of the last 1)
"""

from __future__ import annotations

import torch

__all__ = ["training_record", "training_lines", "plot_loss", "moved"]


def training_record(s, trained, *, sequences: torch.Tensor, budget: int) -> dict:
    """The report's ``training`` entry of a run with settings ``s`` (:class:`~bridge.app.train_loop.Settings`)
    that ``trained`` (:class:`~bridge.app.train_loop.Trained`) on ``sequences`` for a ``budget`` of tokens."""
    seq_len = int(sequences.shape[1])
    return {"steps": s.steps, "batch": s.batch, "seq_len": seq_len, "tokens": s.steps * s.batch * seq_len,
            "budget": budget, "sequences": int(sequences.shape[0]), "lr": s.lr, "range_lr": s.range_lr,
            "weight_decay": s.weight_decay, "ranges_only": s.ranges_only, "distill": s.distill,
            "temperature": s.temperature if s.distill else None, "seed": s.seed, "schedule": s.schedule, "warmup": s.warmup, "resumed_at": trained.resumed_at,
            "seconds": trained.seconds, "loss": list(trained.losses)}


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")


def training_lines(t: dict) -> list[str]:
    """The printed report's lines on training ``t`` (a :func:`training_record`)."""
    how = f"AdamW lr {t['lr']:g}, ranges {t['range_lr']:g}" if not t["ranges_only"] else \
        f"AdamW on the ranges alone (lr {t['range_lr']:g}), every weight frozen"
    if t["schedule"] != "constant" or t["warmup"]:
        how += f"; {t['warmup']} warm-up steps, then {t['schedule']}"
    if t["weight_decay"]:
        how += f", weight decay {t['weight_decay']:g}"
    if t["distill"]:
        how += f"; distilled from the float model (temperature {t['temperature']:g})"
    lines = ["", f"training: {t['steps']} steps x {t['batch']} x {t['seq_len']} tokens = {t['tokens']} tokens (budget "
             f"{t['budget']}) on {t['sequences']} sequences; {how}"]
    loss = t["loss"]
    k = max(1, min(10, len(loss) // 10))
    if loss:
        lines.append(f"loss: {_mean(loss[:k]):.4f} (mean of the first {k} steps) -> {_mean(loss[-k:]):.4f} "
                     f"(mean of the last {k})")
    if t["resumed_at"] is not None:
        lines.append(f"resumed at step {t['resumed_at']} from the saved training state")
    return lines


def plot_loss(ax, t: dict) -> None:
    """The loss of every step of training ``t`` on the matplotlib axes ``ax``, with its running mean."""
    loss = t["loss"]
    steps = list(range(1, len(loss) + 1))
    ax.plot(steps, loss, lw=0.8, alpha=0.5, color="tab:blue", label="per step")
    w = max(1, len(loss) // 20)
    if w > 1:
        mean = [_mean(loss[max(0, i - w + 1):i + 1]) for i in range(len(loss))]
        ax.plot(steps, mean, lw=1.5, color="tab:red", label=f"mean of {w} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("loss" + (" (cross entropy + KL to the float model)" if t["distill"] else " (cross entropy)"))
    ax.set_title(f"training: {t['tokens']} tokens")
    ax.legend(fontsize=7)


def moved(prepared: torch.nn.Module, params: dict, plan) -> dict:
    """``{path: {"weight_change": ||W_trained - W||² / ||W||²}}`` of each quantized weight of the trained
    ``prepared`` model against ``params`` (the float model's tree): how far training (and the recipe's steps)
    moved the float weight the codes are taken from."""
    info = {}
    for path in plan.specs:
        module = prepared.get_submodule(path.rpartition(".")[0])
        trained = module.parametrizations.weight.original.detach().float()
        w = params[path].detach().float()
        info[path] = {"weight_change": float((trained - w).pow(2).sum() / w.pow(2).sum().clamp(min=1e-30))}
    return info
