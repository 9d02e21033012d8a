"""Write a second evaluation text: the docstrings of an installed package that neither part of the built-in
corpus uses (default: ``transformers.generation.utils`` and ``.logits_process``), one document per docstring, to check
that a quality change measured on the built-in text holds on another.

    python bench/docstring_corpus.py OUT.txt [module ...]
"""

from __future__ import annotations

import sys

from bridge.app.corpus import CALIBRATION_MODULES, EVAL_MODULES, _module_docs, _unique


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:] or ["transformers.generation.utils", "transformers.generation.logits_process"]
    clash = sorted(set(names) & (set(EVAL_MODULES) | set(CALIBRATION_MODULES)))
    if clash:
        raise SystemExit(f"{clash}: already in the built-in corpus")
    docs = _unique([d for n in names for d in _module_docs(n)])
    with open(out, "w") as f:
        f.write("\n\n".join(docs))
    print(f"{len(docs)} docstrings, {sum(map(len, docs))} characters -> {out}")


if __name__ == "__main__":
    main()
