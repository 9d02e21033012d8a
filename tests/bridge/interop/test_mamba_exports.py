"""Mamba-2's family (Mamba-2, and the hybrids Bamba, Nemotron-H, Falcon-H1, GraniteMoE-Hybrid) through the
compressed-tensors and Quark exports, the way a user runs them: ``qtransform quantize --to TARGET`` on a
transformers directory.

Their configs carry ``time_step_limit: (0.0, inf)``, which transformers 5 writes into ``config.json`` as
``{"__float__": "Infinity"}`` and decodes only in ``from_pretrained``'s file reader. The exports read that
``config.json`` to build the model's module classes; before :mod:`bridge.checkpoint.config_file` they handed
the tagged object to ``Config.from_dict``, whose strict validation refused it ("the config's encoding of
infinity is not read"), so every export of these models crashed (issue 51).

The import must hold the very codes and scales, so its logits equal (``torch.equal``) those of the model
``bridge.quantize`` gives in memory with the same recipe, under the same thread count. What an exporter cannot
name (GraniteMoE-Hybrid's fused experts) is refused by tensor path with a ``ValueError``.
"""

import json
import math

import pytest
import torch
import transformers as tf

import bridge
import qtransform as qt
import tiny_lm
from bridge import interop
from bridge.app.cli import main
from bridge.app.imported import load_imported
from bridge.checkpoint import config_file

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.tensor([[1, 5, 9, 2, 17, 3, 30, 4, 11, 7]])
TARGETS = ("compressed-tensors", "quark")
TAGGED_LIMIT = [0.0, {"__float__": "Infinity"}]  # how transformers 5 writes time_step_limit (strict JSON)
MAMBA = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, max_position_embeddings=64)
MAMBA2 = dict(state_size=16, expand=2, head_dim=16, num_heads=8, n_groups=1, chunk_size=16)


def _model(arch):
    torch.manual_seed(0)
    if arch == "mamba2":
        cfg = tf.Mamba2Config(**MAMBA2, **MAMBA)
        cls = tf.Mamba2ForCausalLM
    else:  # a hybrid: layer 0 Mamba-2, layer 1 attention, each with a feed-forward
        hybrid = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
                      mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16, **MAMBA)
        if arch == "bamba":
            cfg, cls = tf.BambaConfig(attn_layer_indices=[1], **hybrid), tf.BambaForCausalLM
        else:  # granitemoehybrid: a mixture of experts (fused, as transformers 5 holds them) in every layer
            cfg = tf.GraniteMoeHybridConfig(layer_types=["mamba", "attention"], num_local_experts=4,
                                            num_experts_per_tok=2, shared_intermediate_size=128, **hybrid)
            cls = tf.GraniteMoeHybridForCausalLM
    assert tuple(cfg.time_step_limit) == (0.0, math.inf)
    model = cls(cfg).eval()
    model.config.architectures = [cls.__name__]
    return model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root, dirs = tmp_path_factory.mktemp("mamba"), {}
    for arch in ("mamba2", "bamba", "granitemoehybrid"):
        dirs[arch] = root / arch
        _model(arch).save_pretrained(dirs[arch])
        tiny_lm.tokenizer().save_pretrained(dirs[arch])
        assert json.loads((dirs[arch] / "config.json").read_text())["time_step_limit"] == TAGGED_LIMIT
    return dirs


def _quantize_to(model_dir, to, out, *extra):
    """``qtransform quantize --to`` with its default driver (streamed, for a directory); the export's path."""
    rc = main(["quantize", "--model", str(model_dir), "--recipe", "int4-g32", "--no-eval", "--out", str(out),
               "--threads", "1", "--to", to, *extra])
    assert rc == 0
    return out.with_name(f"{out.name}-{to}")


def _in_memory_logits(model_dir):
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return bridge.quantize(model, qt.get_preset("int4-g32").recipe)(IDS).logits


@pytest.mark.parametrize("to", TARGETS)
@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_export_keeps_infinity_and_imports_the_same_logits(arch, to, model_dirs, tmp_path):
    exported = _quantize_to(model_dirs[arch], to, tmp_path / "ckpt")
    # config.json keeps the infinity, as transformers writes and reads it
    assert json.loads((exported / "config.json").read_text())["time_step_limit"] == TAGGED_LIMIT
    assert tuple(tf.AutoConfig.from_pretrained(exported).time_step_limit) == (0.0, math.inf)
    got, want = interop.IMPORTERS[to].read(exported), interop.read_source(tmp_path / "ckpt")
    assert got.config["time_step_limit"] == want.config["time_step_limit"] == [0.0, math.inf]
    quantized = {p for p, leaf in want.tree.items() if isinstance(leaf, qt.QTensor)}
    assert {p for p, leaf in got.tree.items() if isinstance(leaf, qt.QTensor)} == quantized
    assert any(".in_proj." in p for p in quantized) and any(".out_proj." in p for p in quantized)
    for p in quantized:
        assert torch.equal(got.tree[p].codes, want.tree[p].codes), p
    with torch.no_grad():
        imported = load_imported(exported)(IDS).logits
    assert torch.equal(imported, _in_memory_logits(model_dirs[arch]))


@pytest.mark.parametrize("to", ["compressed-tensors", pytest.param("quark", marks=pytest.mark.slow)])  # Quark: 20 s import
def test_transformers_loads_the_hybrid_export(to, model_dirs, tmp_path):
    """transformers' own loader (compressed-tensors', Quark's) reads the export of Bamba; its logits are ours
    computed on the dequantized weights. (Mamba-2's compressed-tensors export is left out: transformers 5.25's
    ``Mamba2PreTrainedModel._init_weights`` reads ``out_proj.weight``, which compressed-tensors has replaced.)"""
    exported = _quantize_to(model_dirs["bamba"], to, tmp_path / "ckpt", "--in-memory")
    with torch.no_grad():
        theirs = tf.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()(IDS).logits
        ours = load_imported(exported, kernel="dequant")(IDS).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


@pytest.mark.parametrize("to", TARGETS)
def test_fused_experts_of_a_hybrid_are_refused_by_name(to, model_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    bridge.save(bridge.quantize(tf.AutoModelForCausalLM.from_pretrained(model_dirs["granitemoehybrid"]).eval(),
                                qt.get_preset("int4-g32").recipe), ckpt)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.block_sparse_moe\.experts\.gate_up_proj: "
                                         "mixture-of-experts weights of this model type"):
        interop.export(ckpt, to=to, out=tmp_path / to)
    assert not (tmp_path / to).exists()


def test_config_file_reads_both_encodings_and_writes_transformers_own(tmp_path):
    """transformers 4 wrote Python's bare ``Infinity``; transformers 5 a tagged object: both read as floats,
    and what is written is what the installed transformers writes."""
    (tmp_path / "bare.json").write_text('{"time_step_limit": [0.0, Infinity], "x": -Infinity}')
    assert config_file.read_config(tmp_path / "bare.json") == {"time_step_limit": [0.0, math.inf], "x": -math.inf}
    cfg = tf.Mamba2Config(**MAMBA2, **MAMBA)
    cfg.save_pretrained(tmp_path / "hf")
    read = config_file.read_config(tmp_path / "hf" / "config.json")
    assert read["time_step_limit"] == [0.0, math.inf]
    config_file.write_config(tmp_path / "ours.json", read)
    assert (json.loads((tmp_path / "ours.json").read_text())
            == json.loads((tmp_path / "hf" / "config.json").read_text()))
    again = tf.Mamba2Config.from_pretrained(tmp_path / "ours.json")
    assert tuple(again.time_step_limit) == (0.0, math.inf)
