"""Damaged GGUF files through ``bridge.load``: a clear :class:`~bridge.CheckpointError` naming the file and
the tensor or key, never a raw exception of the ``gguf`` package nor a model built from wrong bytes.

The files are copies of one tiny Q4_0 llama export, edited in place through the ``gguf`` package's reader
opened read-write (its fields are views of the file)."""

import json
import shutil

import numpy as np
import pytest
import torch
from bridge_util import tiny_causal_lm

import bridge
from bridge import interop
from bridge.interop.gguf import GGUFImporter, checks
from bridge.interop.gguf import tensors as gguf_tensors

gguf = pytest.importorskip("gguf")

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 127]])


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-damaged")
    torch.manual_seed(0)
    bridge.save(bridge.quantize(tiny_causal_lm("llama").eval(), gguf_tensors.IMPORT_SPECS["Q4_0"]), root / "ck")
    out = interop.export(root / "ck", to="gguf", out=root / "g")
    want = bridge.load(root / "ck", like=tiny_causal_lm("llama"))(IDS).logits.detach()
    return next(out.glob("*.gguf")), want


@pytest.fixture
def copy(export, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(export[0], path)
    return path


def _edit(path, fn):
    """Apply ``fn(reader)`` to the file through a read-write reader (its arrays write through)."""
    reader = gguf.GGUFReader(str(path), "r+")
    fn(reader)
    reader.data.flush()
    del reader


def _tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


def _load(path, **kw):
    return bridge.load(path, like=tiny_causal_lm("llama"), **kw)


def _refused(path, match, **kw):
    with pytest.raises(bridge.CheckpointError, match=match) as info:
        _load(path, **kw)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_the_export_carries_digests_and_loads(export):
    path, want = export
    reader = gguf.GGUFReader(str(path))
    table = json.loads(reader.fields[checks.DIGESTS].contents())
    assert set(table) == {t.name for t in reader.tensors}
    assert checks.check_digests(reader, path)
    assert torch.equal(_load(path)(IDS).logits, want)


# --------------------------------------------------------------------------- the reader's own errors
@pytest.mark.parametrize("keep", [0.02, 0.1, 0.3, 0.5, 0.9, 0.999])
def test_truncated_files_are_refused(copy, keep):
    data = copy.read_bytes()
    copy.write_bytes(data[:max(8, int(len(data) * keep))])
    _refused(copy, "m.gguf")


def test_edited_header_counts_are_refused(copy):
    def counts(r):
        r.fields["GGUF.kv_count"].parts[0][0] = 10_000
    _edit(copy, counts)
    _refused(copy, "not a readable GGUF file")


def test_unknown_tensor_type_is_refused(copy):
    _edit(copy, lambda r: r.tensors[3].field.parts[4].__setitem__(0, 250))
    _refused(copy, "tensor blk.0.ffn_gate.weight: unknown GGML type 250")


# --------------------------------------------------------------------------- extents
def test_type_edited_to_a_larger_one_is_refused_before_reading_neighbours(copy):
    _edit(copy, lambda r: _tensor(r, "blk.0.attn_q.weight").field.parts[4].__setitem__(
        0, gguf.GGMLQuantizationType.F16))
    _refused(copy, r"tensors blk\.0\.attn_q\.weight \(bytes .*\) and blk\.0\.attn_v\.weight .* overlap")


def test_last_tensor_past_the_end_is_refused(copy):
    def grow(r):
        last = max(r.tensors, key=lambda t: t.data_offset)
        last.field.parts[3][0] = 1024
    _edit(copy, grow)
    _refused(copy, r"tensor output_norm\.weight \(F32, shape \[1024\]\) needs bytes .* which holds")


def test_misaligned_offset_is_refused(copy):
    _edit(copy, lambda r: _tensor(r, "blk.1.attn_v.weight").field.parts[5].__setitem__(0, 49536 + 4))
    _refused(copy, r"tensor blk\.1\.attn_v\.weight: offset 49540 is not a multiple of the file's alignment 32")


def test_rows_of_partial_blocks_are_refused(copy):
    _edit(copy, lambda r: _tensor(r, "blk.0.attn_k.weight").field.parts[3].__setitem__(0, 40))
    _refused(copy, r"tensor blk\.0\.attn_k\.weight: shape \[40, 32\] is not rows of whole Q4_0 blocks")


def test_check_extents_directly():
    class F:
        def __init__(self, name, kind, dims, offset):
            self.parts = [None, np.frombuffer(name.encode(), np.uint8), None, np.array(dims, np.uint64),
                          np.array([kind], np.uint32), np.array([offset], np.uint64)]
    ok = [F("a", 0, [4], 0), F("b", 0, [4], 32)]  # F32: 16 bytes each
    checks.check_extents(ok, start=64, size=64 + 48, alignment=32, path="f")
    with pytest.raises(bridge.CheckpointError, match="f: tensor b .* needs bytes 32 to 48 .* holds 40"):
        checks.check_extents(ok, start=64, size=104, alignment=32, path="f")
    with pytest.raises(bridge.CheckpointError, match=r"tensors a \(bytes 0 to 64.*\) and b \(from byte 32\) overlap"):
        checks.check_extents([F("a", 0, [16], 0), F("b", 0, [4], 32)], start=0, size=200, alignment=32, path="f")


# --------------------------------------------------------------------------- metadata keys
def test_missing_key_is_named(copy):
    key = "llama.attention.head_count"
    _edit(copy, lambda r: r.fields[key].parts[1].__setitem__(-1, ord("X")))  # renamed: ...head_counX
    _refused(copy, f"metadata key '{key}' is missing")


def test_mistyped_key_is_named(copy):
    _edit(copy, lambda r: r.fields["llama.block_count"].parts[2].__setitem__(0, gguf.GGUFValueType.FLOAT32))
    _refused(copy, "metadata key 'llama.block_count' is FLOAT32, expected one int")


def test_zero_count_is_refused(copy):
    _edit(copy, lambda r: r.fields["llama.embedding_length"].parts[-1].__setitem__(0, 0))
    _refused(copy, "metadata key 'llama.embedding_length' is 0, expected a positive count")


def test_architecture_of_another_family_is_refused(copy):
    def arch(r):
        r.fields["general.architecture"].parts[-1][:] = np.frombuffer(b"gemma", np.uint8)
    _edit(copy, arch)
    _refused(copy, "general.architecture 'gemma': GGUF import supports")


# --------------------------------------------------------------------------- hyperparameters against like
@pytest.mark.parametrize("key, value, hf, mine", [
    ("llama.attention.head_count", 2, "num_attention_heads", 4),
    ("llama.attention.head_count_kv", 4, "num_key_value_heads", 2),
    ("llama.block_count", 1, "num_hidden_layers", 2),
])
def test_hyperparameters_that_disagree_with_like_are_refused(copy, key, value, hf, mine):
    _edit(copy, lambda r: r.fields[key].parts[-1].__setitem__(0, value))
    _refused(copy, rf"{key} is {value}, the model's {hf} \(LlamaForCausalLM\) is {mine}")


def test_architecture_that_disagrees_with_like_is_refused(export):
    with pytest.raises(bridge.CheckpointError, match=r"general.architecture is 'llama', the model's "
                                                     r"\(Qwen2ForCausalLM, model_type 'qwen2'\) is 'qwen2'"):
        bridge.load(export[0], like=tiny_causal_lm("qwen2"))


# --------------------------------------------------------------------------- digests
def _swap_offsets(r, a, b):
    pa, pb = _tensor(r, a).field.parts[5], _tensor(r, b).field.parts[5]
    pa[0], pb[0] = int(pb[0]), int(pa[0])


def test_swapped_tensors_are_refused_by_their_digest(copy, export):
    _edit(copy, lambda r: _swap_offsets(r, "blk.0.attn_q.weight", "blk.0.attn_output.weight"))
    _refused(copy, r"tensor blk\.0\.attn_(q|output)\.weight: its bytes do not match their SHA-256 digest")
    other = _load(copy, verify=False)(IDS).logits  # unverified: it loads, with other numbers
    assert not torch.equal(other, export[1])


def test_bit_flip_in_tensor_data_is_refused(copy):
    def flip(r):
        t = _tensor(r, "blk.1.ffn_up.weight")
        r.data[t.data_offset + 100] ^= 0x10
    _edit(copy, flip)
    _refused(copy, r"tensor blk\.1\.ffn_up\.weight: its bytes do not match")


def test_type_edited_to_one_of_the_same_size_is_refused_by_its_digest(copy):
    _edit(copy, lambda r: _tensor(r, "output_norm.weight").field.parts[4].__setitem__(0, gguf.GGMLQuantizationType.I32))
    _refused(copy, r"tensor output_norm\.weight is I32, its digest says F32")


def test_malformed_digests_are_refused(copy):
    _edit(copy, lambda r: r.fields[checks.DIGESTS].parts[-1].__setitem__(0, ord("x")))
    _refused(copy, r"metadata key 'qtransform.tensor_sha256' is malformed")


def test_files_without_digests_load_unverified(copy, export):
    _edit(copy, lambda r: r.fields[checks.DIGESTS].parts[1].__setitem__(-1, ord("X")))  # another, unknown key
    assert torch.equal(_load(copy)(IDS).logits, export[1])
    src = GGUFImporter().read(copy)
    assert set(src.tree) >= {"model.layers.0.self_attn.q_proj.weight"}


def test_verify_must_be_a_bool(export):
    with pytest.raises(TypeError, match="verify must be True or False"):
        GGUFImporter().read(export[0], verify="yes")


def test_renamed_tensor_is_refused_by_name(copy):
    _edit(copy, lambda r: _tensor(r, "blk.0.attn_q.weight").field.parts[1].__setitem__(0, ord("X")))
    _refused(copy, r"tensor blk\.0\.attn_q\.weight is listed in qtransform.tensor_sha256 but not in the file")
    _refused(copy, r"tensor Xlk\.0\.attn_q\.weight has no transformers name in architecture llama", verify=False)
