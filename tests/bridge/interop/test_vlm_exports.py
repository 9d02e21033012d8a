"""Vision-language checkpoints whose ``config.json`` names no class (a model built from its config, as the walk over
every model type builds them: ``architectures`` unset) through every export that rebuilds the transformers model.
Found by :mod:`walk.test_every_export`:

- :func:`bridge.interop.hf_model.transformers_model` tried no image-text-to-text head, so for Llava the only class it
  built was the bare ``LlavaModel`` (paths without ``model.``): Quark and ONNX refused the checkpoint ("no
  transformers class of model_type 'llava' has every tensor"), compressed-tensors every weight ("no module");
- compressed-tensors built its skeleton without the checkpoint's paths, so Qwen3.5's composite config gave the
  text-only ``Qwen3_5ForCausalLM`` (the first head that builds) and every weight was "no module";
- the ONNX export turned the cache off in the top config only; a VLM's language model reads its text config and
  returned a ``DynamicCache``, which ``torch.export`` cannot hold (a crash).

Expected values: the checkpoint's own tree (read back bit for bit) and the quantized model's logits.
"""

import pytest
import torch
from interop.onnx.helpers import EXACT, DISABLED, run_onnx
from walk.export_checks import imported_logits
from walk.tiny_any import ENTRIES, build, tokens
from walk.walk_checks import close, logits, same_trees

import bridge
import qtransform as qt
from bridge import interop
from bridge.interop.base import read_imported
from bridge.interop.hf_model import model_paths, transformers_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
RECIPE = qt.get_preset("int4-g32").recipe


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for entry, cls in (("llava", "LlavaForConditionalGeneration"), ("qwen3_5-vlm", "Qwen3_5ForConditionalGeneration")):
        model = build(ENTRIES[entry])
        assert type(model).__name__ == cls and not model.config.architectures  # the config names no class
        qmodel = bridge.quantize(model, RECIPE, kernel="dequant")
        ckpt = tmp_path_factory.mktemp(entry) / "q"
        bridge.save(qmodel, ckpt)
        out[entry] = (model, qmodel, ckpt)
    return out


@pytest.mark.parametrize("entry", ["llava", "qwen3_5-vlm"])
def test_the_model_class_is_the_one_holding_every_tensor(entry, checkpoints):
    model, _, ckpt = checkpoints[entry]
    source = interop.read_source(ckpt)
    assert type(transformers_model(source.config, paths=model_paths(source))) is type(model)


@pytest.mark.parametrize("to", ["compressed-tensors", "quark"])
@pytest.mark.parametrize("entry", ["llava", "qwen3_5-vlm"])
def test_export_is_written_and_read_back_with_our_logits(entry, to, checkpoints, tmp_path):
    model, qmodel, ckpt = checkpoints[entry]
    out = interop.export(ckpt, to=to, out=tmp_path / to)
    same_trees(read_imported(to, out).tree, interop.read_source(ckpt).tree)
    ids = tokens(model, batch=2)
    close(imported_logits(out, ids), logits(qmodel, ids))


def test_onnx_export_of_a_vlm_gives_our_logits(checkpoints, tmp_path):
    model, qmodel, ckpt = checkpoints["llava"]
    out = interop.export(ckpt, to="onnx", out=tmp_path / "onnx")
    ids = tokens(model, batch=2)
    got = run_onnx({"llava": {"model": out / "model.onnx", "ids": ids, "options": EXACT, "disabled": DISABLED}},
                   tmp_path)
    assert "llava:error" not in got, str(got.get("llava:error"))
    with torch.no_grad():
        want = qmodel(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    close(torch.from_numpy(got["llava"]), want)
