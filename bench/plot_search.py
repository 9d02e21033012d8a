"""The measured Pareto plot of the mixed-precision benchmark: perplexity ratio against bits per weight on SmolLM2-135M,
the searched recipes at each budget (one line per estimate) and every uniform scheme (marked), from
``bench/results/search.json`` (written by ``bench/bench_search.py``) to ``docs/search_pareto.png``.

    .venv/bin/python bench/plot_search.py [--json bench/results/search.json] [--out docs/search_pareto.png]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

HERE = pathlib.Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(HERE / "results" / "search.json"))
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "search_pareto.png"))
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(pathlib.Path(a.json).read_text())
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for estimate, style in (("fisher", "o-"), ("hessian", "s--")):
        rows = sorted((r for r in data["rows"] if r.get("estimate", "hessian") == estimate), key=lambda r: r["bits"])
        if rows:
            label = {"fisher": "searched, Fisher-weighted estimate (default)",
                     "hessian": "searched, plain output error tr(E H Eᵀ)"}[estimate]
            ax.plot([r["bits"] for r in rows], [r["ratio"] for r in rows], style, label=label)
    for name, u in data["uniform"].items():
        ax.scatter([u["bits"]], [u["ratio"]], marker="x", color="tab:red")
        ax.annotate(name, (u["bits"], u["ratio"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight of the linear layers (scales and zero points counted)")
    ax.set_ylabel("perplexity ratio, quantized / float (log)")
    ax.set_title("SmolLM2-135M: searched recipes (lines) and uniform schemes (x), round to nearest", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = a.out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
