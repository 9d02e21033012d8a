"""The README's Python examples run as written, in order (a later block may use what an earlier one
registered, as a reader would); what they register is removed again afterwards."""

import pathlib
import re

import pytest

import qtransform as qt

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
REGISTRIES = (qt.FORMATS, qt.OBSERVERS, qt.ALGORITHMS, qt.PRESETS)


def readme_block(first_line: str, lang: str = "python") -> str:
    """The README's ``lang`` block whose first line is ``first_line`` (e.g. ``# shrink.py: ...``)."""
    for block in re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S):
        if block.startswith(first_line):
            return block
    raise LookupError(f"no {lang} block of the README starts with {first_line!r}")


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    first_block = text.split("```")[1]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]


@pytest.fixture(scope="module")
def registered_by_the_readme():
    before = [set(r) for r in REGISTRIES]
    yield
    for registry, names in zip(REGISTRIES, before):
        for name in set(registry) - names:
            registry.unregister(name)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(index, registered_by_the_readme):
    exec(compile(BLOCKS[index], f"{README}:block{index}", "exec"), {})
