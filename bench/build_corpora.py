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
import inspect
import pkgutil
import sys
import warnings
from pathlib import Path

PACKAGES = ("click", "jinja2", "networkx", "dateutil", "markdown_it", "pygments")


def _docstrings(module) -> list[str]:
    found = [module.__doc__]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            found.append(obj.__doc__)
            found += [getattr(m, "__doc__", None) for k, m in sorted(vars(obj).items())
                      if not k.startswith("_") and (inspect.isfunction(m) or isinstance(m, property))]
        elif inspect.isfunction(obj):
            found.append(obj.__doc__)
    return [inspect.cleandoc(d) for d in found if isinstance(d, str) and len(d.strip()) >= 40]


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
                    docs = _docstrings(mod)
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
