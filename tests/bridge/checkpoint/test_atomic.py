"""``store.atomic_directory``: a failure leaves nothing behind (no temporary directory, no parent
directories it created) and never loses the directory it was to replace."""

import os
from pathlib import Path

import pytest

from bridge.checkpoint import store


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_a_failure_removes_the_parents_it_created(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(RuntimeError, match="boom"):
        with store.atomic_directory(tmp_path / "a" / "b" / "c" / "ck") as tmp:
            (tmp / "x").write_text("half")
            raise RuntimeError("boom")
    assert _names(tmp_path) == ["a"] and _names(tmp_path / "a") == []


def test_the_temporary_directory_is_named_for_the_cleanup(tmp_path):
    with store.atomic_directory(tmp_path / "ck") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".ck.tmp-")
        assert store._stale(tmp, tmp_path / "ck", 0) is False  # a live save's directory is never stale
    assert _names(tmp_path) == ["ck"]


def test_a_failed_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    target = tmp_path / "ck"
    target.mkdir()
    (target / "old.txt").write_text("keep")
    real = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".ck.tmp-"):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(store.os, "rename", rename)
    with pytest.raises(OSError, match="No space left"):
        with store.atomic_directory(target, overwrite=True) as tmp:
            (tmp / "new.txt").write_text("new")
    assert _names(tmp_path) == ["ck"] and (target / "old.txt").read_text() == "keep"
    assert _names(target) == ["old.txt"]


def test_overwrite_replaces_and_leaves_no_debris(tmp_path):
    target = tmp_path / "ck"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with store.atomic_directory(target, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert _names(tmp_path) == ["ck"] and _names(target) == ["new.txt"]
