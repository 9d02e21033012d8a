"""The C++ kernel builder: one build directory per (source, flags, torch, environment), and a lock left
by a killed build does not block later processes forever."""

import os
import time

from bridge.kernels import native


def test_build_directory_follows_the_source_bytes_and_place(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }\n")
    da = native.build_directory(a, "k")
    assert native.build_directory(a, "k") == da  # the same source: the same build
    a.write_text("int f() { return 2; }\n")
    assert native.build_directory(a, "k") != da  # other bytes: another build
    b.write_text("int f() { return 2; }\n")
    # the same bytes in another checkout: its own build (the ninja file names the source by its path)
    db = native.build_directory(b, "k")
    assert db != native.build_directory(a, "k") and da.parent == db.parent == tmp_path / "cache" / "qtransform"
    assert da.name.startswith("k-")


def test_stale_lock_is_removed_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    native._remove_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running
    old = time.time() - native.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    native._remove_stale_lock(tmp_path)
    assert not lock.exists()
    native._remove_stale_lock(tmp_path)  # no lock: nothing to do
