"""What bridge.save leaves on disk: the same bytes every time, normal permissions, no debris of
interrupted saves; and every registered format through from_pretrained."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import qtransform as qt
import bridge
from bridge.checkpoint import store
from bridge_util import format_specs, tiny_causal_lm

SAVE = """
import sys, torch, qtransform as qt, bridge
sys.path.insert(0, {tests!r})
from bridge_util import tiny_causal_lm
torch.manual_seed(0)
model = tiny_causal_lm("llama").eval()
recipe = qt.Recipe(default=qt.QuantSpec(format="int4", granularity=qt.PerGroup(32), symmetric=False),
                   rules={{"*up_proj*": qt.QuantSpec(format="mxfp4")}}, steps=["hqq"], exclude=["lm_head*"])
bridge.save(bridge.quantize(model, recipe), sys.argv[1], max_shard_size=30_000, recipe_name="test")
"""


def files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_save_is_byte_identical_across_processes(tmp_path):
    script = SAVE.format(tests=str(Path(__file__).parents[1]))
    outs = []
    for seed in ("1", "2"):  # different hash seeds: set and dict iteration orders differ
        out = tmp_path / f"ck{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", script, str(out)], check=True, env=env, cwd=Path(__file__).parents[3])
        outs.append(files(out))
    assert len([n for n in outs[0] if n.endswith(".safetensors")]) >= 2  # sharded, with an index
    assert outs[0].keys() == outs[1].keys()
    for name in outs[0]:
        assert outs[0][name] == outs[1][name], name


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_files_follow_the_umask(tmp_path, umask):
    model = torch.nn.Sequential(torch.nn.Linear(32, 16))
    old = os.umask(umask)
    try:
        bridge.save(bridge.quantize(model, qt.QuantSpec(format="int8")), tmp_path / "ck")
    finally:
        os.umask(old)
    d = tmp_path / "ck"
    assert d.stat().st_mode & 0o777 == 0o777 & ~umask
    for p in d.iterdir():
        assert p.stat().st_mode & 0o777 == 0o666 & ~umask, p.name


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporary_directories_are_removed_live_ones_kept(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 16))
    q = bridge.quantize(model, qt.QuantSpec(format="int8"))
    host = store._HOST
    dead = tmp_path / f".ck.tmp-{host}-{_dead_pid()}-0123abcd"      # killed save on this host
    live = tmp_path / f".ck.tmp-{host}-{os.getppid()}-4567abcd"     # a save still running here
    elsewhere = tmp_path / ".ck.tmp-otherhost-12345-89abcdef"       # another host's save, recent
    old = tmp_path / ".ck.tmp-k2j3h4"                               # tempfile's naming, a day old
    fresh = tmp_path / ".ck.tmp-x9y8z7"                             # tempfile's naming, recent
    other_target = tmp_path / f".other.tmp-{host}-{_dead_pid()}-0123abcd"
    for p in (dead, live, elsewhere, old, fresh, other_target):
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"partial")
    day_ago = time.time() - store.STALE_AFTER_S - 60
    os.utime(old, (day_ago, day_ago))
    bridge.save(q, tmp_path / "ck")
    left = {p.name for p in tmp_path.iterdir()}
    assert dead.name not in left and old.name not in left
    assert {live.name, elsewhere.name, fresh.name, other_target.name, "ck"} <= left
    assert not [n for n in left if n.startswith(".ck.") and n not in {live.name, elsewhere.name, fresh.name}]


@pytest.mark.parametrize("spec", format_specs(32), ids=str)
def test_every_format_loads_through_from_pretrained(spec, tmp_path):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = tiny_causal_lm("llama").eval()
    qmodel = bridge.quantize(model, qt.Recipe(default=spec, exclude=["lm_head*", "*embed*"]))
    bridge.save(qmodel, tmp_path / "ck")
    ids = torch.randint(3, 100, (1, 7))
    with torch.no_grad():
        ref = qmodel(ids).logits
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")(ids).logits
        b = bridge.load(tmp_path / "ck", like=model)(ids).logits
    assert torch.equal(a, ref) and torch.equal(b, ref)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"info": {}}, TypeError, "unexpected keyword argument 'info'"),
    ({"tokenizer": 5}, TypeError, "save: tokenizer must have a save_pretrained method"),
    ({"rules": [1]}, TypeError, "save: rules must be a dict"),
    ({"overwrite": "yes"}, TypeError, "save: overwrite must be True or False"),
    ({"recipe": 5}, TypeError, "recipe must be a qtransform Recipe or QuantSpec, got int"),
    ({"max_shard_size": -1}, ValueError, "max_shard_size must be a positive int"),
])
def test_save_arguments_checked_before_writing(tmp_path, kwargs, error, message):
    q = bridge.quantize(torch.nn.Sequential(torch.nn.Linear(32, 16)), qt.QuantSpec(format="int8"))
    with pytest.raises(error, match=message):
        bridge.save(q, tmp_path / "ck", **kwargs)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary directory
