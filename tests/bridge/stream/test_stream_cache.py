"""A model whose forward does not name ``use_cache`` (GraniteMoe): the streamed run carries no cache between
calibration passes either, and writes the bytes of the in-memory run (which carries none: see
tests/bridge/calibrate/test_no_cache_carried.py)."""

import torch
import transformers as tf

import qtransform as qt
from bridge.stream import quantize_checkpoint

from stream_util import digests, in_memory

CALIB = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]


def test_gptq_streamed_on_a_model_without_use_cache_writes_the_in_memory_bytes(tmp_path):
    torch.manual_seed(0)
    cfg = tf.GraniteMoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    tf.GraniteMoeForCausalLM(cfg).eval().save_pretrained(tmp_path / "src")
    recipe = qt.get_preset("gptq4-g64").recipe
    quantize_checkpoint(tmp_path / "src", tmp_path / "streamed", recipe, calibration=CALIB)
    in_memory(tmp_path / "src", tmp_path / "memory", recipe, calibration=CALIB)
    streamed, memory = digests(tmp_path / "streamed"), digests(tmp_path / "memory")
    assert streamed["model.safetensors"] == memory["model.safetensors"]
