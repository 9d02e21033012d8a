"""The float transformers model the ONNX export rebuilds from a checkpoint (:func:`bridge.interop.hf_model.float_model`)
and the forwards it cannot trace. Found by :mod:`walk.test_every_export`:

- a checkpoint whose output projection is quantized while the input embedding tied to it (by the config) is kept in
  float holds two different tensors under the tied paths; ``float_model`` loaded both into the one tied parameter,
  so the last one won and the ONNX graph computed with a changed embedding (BioGPT, XLM, BERT...: logits off by
  up to 0.06). Each path now gets its own parameter where the values differ;
- a composite model's text part (``MllamaForCausalLM`` of ``MllamaTextConfig``) was built by no auto class, so every
  export refused it; the classes registered for the config's own class are tried last;
- a model whose forward needs more than token ids (BLIP's pixel values) or that ``torch.onnx.export`` cannot convert
  (Mamba's) crashed the export with the model's own exception; it is refused with a ``ValueError`` naming the
  class, nothing written.

Expected values: the checkpoint's tree dequantized by ``qt.dequantize`` and the quantized model's logits.
"""

import pytest
import torch
from walk.tiny_any import ENTRIES, build, tokens
from walk.walk_checks import close, logits, same_trees

import bridge
import qtransform as qt
from bridge import interop
from bridge.interop.base import read_imported
from bridge.interop.hf_model import float_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
RECIPE = qt.get_preset("int4-g32").recipe


def _saved(entry, directory):
    model = build(ENTRIES[entry])
    qmodel = bridge.quantize(model, RECIPE, kernel="dequant")
    bridge.save(qmodel, directory)
    return model, qmodel


def test_tied_paths_holding_different_values_get_a_parameter_each(tmp_path):
    model, qmodel, = _saved("biogpt", tmp_path / "q")
    source = interop.read_source(tmp_path / "q")
    emb, out = "biogpt.embed_tokens.weight", "output_projection.weight"
    assert model.output_projection.weight is model.biogpt.embed_tokens.weight  # tied by the config
    assert qt.is_qtensor(source.tree[out]) and not qt.is_qtensor(source.tree[emb])
    rebuilt = float_model(source)
    state = rebuilt.state_dict(keep_vars=True)
    assert torch.equal(state[emb], source.tree[emb])
    assert torch.equal(state[out], qt.dequantize(source.tree[out]))
    ids = tokens(model, batch=2)
    close(logits(rebuilt, ids), logits(qmodel, ids))


def test_tied_paths_holding_one_value_stay_tied(tmp_path):
    _saved("llama", tmp_path / "q")  # tiny_any's Llama ties nothing: tie its embedding in the config
    source = interop.read_source(tmp_path / "q")
    config = dict(source.config, tie_word_embeddings=True)
    tree = dict(source.tree)
    tree["lm_head.weight"] = tree["model.embed_tokens.weight"]
    rebuilt = float_model(source._replace(config=config, tree=tree))
    assert rebuilt.lm_head.weight is rebuilt.model.embed_tokens.weight


@pytest.mark.parametrize("entry, cls, why", [
    ("blip", "BlipForConditionalGeneration", "its forward on input_ids and attention_mask alone fails"),
    ("mamba", "MambaForCausalLM", "torch.onnx.export cannot convert its forward"),
])
def test_onnx_refuses_a_forward_it_cannot_trace_by_class(entry, cls, why, tmp_path):
    _saved(entry, tmp_path / "q")
    with pytest.raises(ValueError, match=f"{cls}: {why}"):
        interop.export(tmp_path / "q", to="onnx", out=tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("entry", ["mllama", "musicgen"])
def test_a_composite_models_text_part_exports_by_its_registered_class(entry, tmp_path):
    """``MllamaForCausalLM``'s config is ``MllamaTextConfig`` (model type ``mllama_text_model``), which no auto class
    builds: every export refused the checkpoint ("no transformers class ... (tried [])")."""
    model, _ = _saved(entry, tmp_path / "q")
    source = interop.read_source(tmp_path / "q")
    assert not model.config.architectures and source.config["model_type"] != ENTRIES[entry].model_type
    out = interop.export(tmp_path / "q", to="quark", out=tmp_path / "quark")
    assert type(float_model(source)) is type(model)
    same_trees(read_imported("quark", out).tree, source.tree)
