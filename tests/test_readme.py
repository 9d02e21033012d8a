"""The Python examples of README.md and docs/*.md run as written: the blocks of one file in order (a
later block may use what an earlier one registered, as a reader would), each file on its own; what a
file's blocks register is removed again after its last block. Blocks not meant to run use other
fences (```bash, ```text, ```toml)."""

import pathlib
import re

import pytest

import qtransform as qt

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
REGISTRIES = (qt.FORMATS, qt.OBSERVERS, qt.ALGORITHMS, qt.PRESETS)


def blocks(path: pathlib.Path, lang: str = "python") -> list[str]:
    """The ``lang`` fenced blocks of ``path``, in order, without their fences (indented fences too)."""
    return [_dedent(b) for b in re.findall(rf"^ *```{lang}\n(.*?)^ *```", path.read_text(), flags=re.S | re.M)]


def _dedent(block: str) -> str:
    import textwrap

    return textwrap.dedent(block)


def doc_block(first_line: str, lang: str = "python") -> str:
    """The ``lang`` block of README.md or docs/*.md whose first line is ``first_line`` (``# shrink.py: ...``)."""
    for path in DOCS:
        for block in blocks(path, lang):
            if block.startswith(first_line):
                return block
    raise LookupError(f"no {lang} block of README.md or docs/*.md starts with {first_line!r}")


#: The name other tests import (``from test_readme import readme_block``).
readme_block = doc_block

CASES = [(path, i) for path in DOCS for i in range(len(blocks(path)))]


def _id(case) -> str:
    path, i = case
    return f"{path.relative_to(ROOT)}:block{i}"


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    first_block = text.split("```")[1]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]


#: The README is the entry point: measured tables and long explanations live in docs/ (performance.md and the
#: page of their topic), the README summarises and links.
README_MAX_LINES = 300


def test_readme_is_an_entry_point_that_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move tables and detail to docs/, link them")
    assert lines[0].startswith("# ") and lines[1] == "", "README.md starts with its title"
    opening = [line.split("#")[0].strip() for line in lines[2:6]]
    assert opening == ["```", "make demo", "make test", "```"], "README.md opens with `make demo` and `make test`"


def test_every_docs_page_is_linked_from_the_readme():
    text = README.read_text()
    assert [p.name for p in DOCS[1:] if f"docs/{p.name}" not in text] == []


def test_docs_links_point_at_files():
    missing = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            if not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)} -> {target}")
    assert missing == []


_registered: dict[pathlib.Path, list[set]] = {}


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_registered():
    """A safety net for runs that skip a file's last block (``-k``): nothing stays registered."""
    before = [set(r) for r in REGISTRIES]
    yield
    for registry, names in zip(REGISTRIES, before):
        for name in set(registry) - names:
            registry.unregister(name)


@pytest.fixture
def registrations_of_the_file(request):
    """Remembers the registries before a file's first block; after its last, removes what it added."""
    path, index = request.param
    if index == 0:
        _registered[path] = [set(r) for r in REGISTRIES]
    try:
        yield path, index
    finally:
        if index == len(blocks(path)) - 1 and path in _registered:
            for registry, names in zip(REGISTRIES, _registered.pop(path)):
                for name in set(registry) - names:
                    registry.unregister(name)


@pytest.mark.parametrize("registrations_of_the_file", CASES, ids=[_id(c) for c in CASES], indirect=True)
def test_doc_example_runs(registrations_of_the_file):
    path, index = registrations_of_the_file
    exec(compile(blocks(path)[index], f"{path}:block{index}", "exec"), {})
