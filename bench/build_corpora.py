"""Two offline evaluation corpora independent of the built-in one (which is the docstrings of some Python
standard-library modules), written as text files for ``qtransform eval --corpus FILE``:

* ``thirdparty_docstrings.txt``: the docstrings of installed third-party packages (click, jinja2, networkx,
  dateutil, markdown_it, pygments: none of them in the built-in corpus), every submodule in name order;
* ``task_readmes.txt``: a different kind of text, the Markdown READMEs of lm-evaluation-harness's task folders
  (English prose about benchmarks, tables, citations), in path order.

Deterministic for a given set of installed packages; the files are not committed (out/ is ignored).

    .venv/bin/python bench/build_corpora.py [--out out/corpora]
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bridge/ next to qtransform/

from bridge.app import corpus  # noqa: E402

PACKAGES = ("click", "jinja2", "networkx", "dateutil", "markdown_it", "pygments")


def package_docstrings(packages=PACKAGES) -> str:
    """The de-duplicated docstrings of every importable submodule of ``packages``."""
    seen, out = set(), []
    for pkg in packages:
        try:
            root = importlib.import_module(pkg)
        except ImportError:
            print(f"skipped {pkg}: not installed", file=sys.stderr)
            continue
        names = [pkg] + sorted(m.name for m in pkgutil.walk_packages(getattr(root, "__path__", []), pkg + "."))
        for name in names:
            if ".tests" in name or ".test_" in name or name.endswith("__main__"):
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    mod = importlib.import_module(name)
                    docs = corpus.module_docstrings(mod)
            except (Exception, SystemExit):  # noqa: BLE001  (a submodule's optional dependencies: skip it)
                continue
            for d in docs:
                if d not in seen:
                    seen.add(d)
                    out.append(d)
    return "\n\n".join(out)


def task_readmes() -> str:
    """lm-evaluation-harness's task READMEs, in path order."""
    import lm_eval

    root = Path(lm_eval.__file__).parent / "tasks"
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace").strip()
                       for p in sorted(root.glob("*/README.md")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/corpora")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("thirdparty_docstrings.txt", package_docstrings()), ("task_readmes.txt", task_readmes())):
        (out / name).write_text(text, encoding="utf-8")
        print(out / name, len(text), "characters")


if __name__ == "__main__":
    main()
