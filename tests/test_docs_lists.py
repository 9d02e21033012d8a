"""Docs that cannot drift: every name a registry holds, and every package and module of the source, has its
line in the page that lists its kind. The expected names are read from the registries and the source tree when
the test runs, so a registration or a file added without its line fails here, naming what is missing and where.

=====================  ==========================================  ==========================================
kind                   read from                                   listed in
=====================  ==========================================  ==========================================
algorithms (steps)     ``qt.ALGORITHMS``                           docs/steps.md, the table's first column
presets                ``qt.presets()``                            docs/command.md, the "Recipes" item
exporters              ``bridge.interop.EXPORTERS``                docs/exports.md, "The targets"
importers              ``bridge.interop.IMPORTERS``                docs/exports.md, "The way back: importers"
formats                ``qt.FORMATS``                              docs/formats.md, the table's first column
packages and modules   qtransform/ and bridge/ (``__init__.py``)   docs/layout.md, the tree
=====================  ==========================================  ==========================================

The registries are read in a fresh interpreter (what ``import qtransform, bridge.interop`` registers), so a
name another test registered for a while is not expected in the docs. Names a page lists that no longer
exist fail too, where the page's list has a fixed form (a table's first column, an item's leading name, the
layout tree)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = ("qtransform", "bridge")

_READ = """
import json
import qtransform as qt
import bridge.interop as interop
print(json.dumps({"algorithms": sorted(qt.ALGORITHMS), "presets": sorted(qt.presets()),
                  "formats": sorted(qt.FORMATS), "exporters": sorted(interop.EXPORTERS),
                  "importers": sorted(interop.IMPORTERS)}))
"""


@pytest.fixture(scope="module")
def registered() -> dict:
    """``{kind: [name, ...]}`` as a fresh ``import qtransform, bridge.interop`` registers them (this tree's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _READ], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _page(name: str) -> str:
    return (DOCS / name).read_text()


def _between(text: str, start: str, end: str, page: str) -> str:
    """The part of ``text`` from the line holding ``start`` to the first match of regex ``end`` after it."""
    at = text.find(start)
    if at < 0:
        raise AssertionError(f"docs/{page}: the list starting at {start!r} is gone (this test reads it)")
    stop = re.compile(end, re.M).search(text, at + len(start))
    return text[at:stop.start() if stop else len(text)]


def _ticked(text: str) -> set[str]:
    """Names in backticks, with ranges written ```int1` … `int8``` expanded (int1, int2, ..., int8)."""
    names = set(re.findall(r"`([^`\n]+)`", text))
    for prefix, lo, prefix2, hi in re.findall(r"`([A-Za-z_]*)(\d+)` … `([A-Za-z_]*)(\d+)`", text):
        if prefix == prefix2:
            names |= {f"{prefix}{i}" for i in range(int(lo), int(hi) + 1)}
    return names


def _first_column(text: str) -> set[str]:
    """The backticked names of the first cell of every table row (header and rule rows hold none)."""
    return {n for cell in re.findall(r"^\|([^|\n]*)\|", text, flags=re.M) for n in _ticked(cell)}


def _missing(expected, listed, kind: str, page: str, where: str) -> list[str]:
    return [f"docs/{page} ({where}) lacks the {kind} {name!r}" for name in sorted(set(expected) - set(listed))]


def _stale(expected, listed, kind: str, page: str, where: str) -> list[str]:
    return [f"docs/{page} ({where}) lists {name!r}, which is no registered {kind}"
            for name in sorted(set(listed) - set(expected))]


def _none(problems: list[str]) -> None:
    assert not problems, "\n" + "\n".join(problems)


def test_every_algorithm_has_its_row_in_steps_md(registered):
    rows = _first_column(_page("steps.md"))
    where = "the table of steps"
    _none(_missing(registered["algorithms"], rows, "algorithm", "steps.md", where)
          + _stale(registered["algorithms"], rows, "algorithm", "steps.md", where))


def test_every_preset_is_named_in_command_md(registered):
    item = _between(_page("command.md"), "- Recipes:", r"^\S|^- |^  or transformers' ", "command.md")
    _none(_missing(registered["presets"], _ticked(item), "preset", "command.md", "the Recipes item"))


def test_every_exporter_and_importer_is_named_in_exports_md(registered):
    text = _page("exports.md")
    targets = _between(text, "The targets:", r"^[^-\s]", "exports.md")
    leading = set(re.findall(r"^- `([^`]+)`", targets, flags=re.M))
    importers = _between(text, "## The way back: importers", r"^## ", "exports.md")
    _none(_missing(registered["exporters"], _ticked(targets), "exporter", "exports.md", "The targets")
          + _stale(registered["exporters"], leading, "exporter", "exports.md", "The targets")
          + _missing(registered["importers"], _ticked(importers), "importer", "exports.md", "The way back: importers"))


def test_every_format_has_its_row_in_formats_md(registered):
    rows = _first_column(_page("formats.md"))
    where = "the table of formats"
    _none(_missing(registered["formats"], rows, "format", "formats.md", where)
          + _stale(registered["formats"], rows, "format", "formats.md", where))


# ---- docs/layout.md: the tree of packages and modules

_ENTRY = re.compile(r"^( {0,8})([\w.]+/|[\w.]+\.py)(?= |$)")
_MODULE = re.compile(r"(?<![\w/<>.])(\w+\.py)\b")


def _layout_entries() -> dict[str, str]:
    """``{path: text}`` of every entry of docs/layout.md's tree under qtransform/ and bridge/: a directory as
    ``bridge/stream/``, a file as ``bridge/io.py``; its text is its line and the description lines after it."""
    text = _page("layout.md")
    tree = next((b for b in re.findall(r"^```text\n(.*?)^```", text, flags=re.S | re.M)
                 if b.startswith(PACKAGES[0] + "/")), None)
    assert tree is not None, "docs/layout.md: the ```text tree starting with qtransform/ is gone (this test reads it)"
    entries, stack, current = {}, [], None
    for line in tree.splitlines():
        m = _ENTRY.match(line)
        if m:
            depth = len(m.group(1)) // 2
            stack = stack[:depth] + [m.group(2)]
            current = "".join(stack)
            entries[current] = line
        elif current is not None:
            entries[current] += "\n" + line
    return {p: t for p, t in entries.items() if p.split("/")[0] in PACKAGES}


def _source() -> tuple[set[str], dict[str, set[str]]]:
    """The packages (``bridge/stream/``) and, per package, its module files (``{"bridge/stream/": {"cache.py"}}``)."""
    packages = {str(p.parent.relative_to(ROOT)) + "/" for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    modules = {pkg: {p.name for p in (ROOT / pkg).glob("*.py") if p.name != "__init__.py"} for pkg in packages}
    return packages, modules


def _package_text(entries: dict[str, str], package: str) -> str:
    """What the tree says of ``package``'s own files: its entry and the entries of the files directly in it."""
    return "\n".join(t for p, t in entries.items()
                     if p == package or (p.endswith(".py") and p.rpartition("/")[0] + "/" == package))


def test_every_package_and_module_is_in_layout_md():
    entries = _layout_entries()
    packages, modules = _source()
    problems = [f"docs/layout.md (the tree) lacks the package {p}" for p in sorted(packages - set(entries))]
    problems += [f"docs/layout.md (the tree) lists {p}, which is no package (no __init__.py)"
                 for p in sorted(set(entries) - packages) if p.endswith("/")]
    for package in sorted(packages & set(entries)):
        named = set(_MODULE.findall(_package_text(entries, package)))
        problems += [f"docs/layout.md (the tree, under {package}) lacks the module {package}{m}"
                     for m in sorted(modules[package] - named)]
        problems += [f"docs/layout.md (the tree, under {package}) names {package}{m}, which does not exist"
                     for m in sorted(named - modules[package])]
    _none(problems)
