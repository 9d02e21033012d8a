"""No key/value cache is carried from one calibration pass to the next, also for a model whose forward does not
name ``use_cache`` (so the calibrator cannot turn it off there): a block's captured inputs hold no cache object."""

import torch
import transformers as tf

import bridge
import qtransform as qt
from bridge.calibrate.blocks import capture_inputs, without_cache
from bridge.tree import extract

CALIB = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _granite():
    """A tiny GraniteMoe: its causal-LM forward takes ``**kwargs`` but no ``use_cache``, and its blocks take the
    cache as ``cache=``."""
    torch.manual_seed(0)
    cfg = tf.GraniteMoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    return tf.GraniteMoeForCausalLM(cfg).eval()


def test_captured_block_inputs_hold_no_cache_and_running_twice_gives_the_same_output():
    model = _granite()
    (args, kwargs), = capture_inputs(model, extract(model), "model.layers.0", CALIB[:1])
    assert not any(callable(getattr(v, "get_seq_length", None)) for v in kwargs.values())
    assert kwargs.get("use_cache") is False
    block = model.model.layers[0]
    with torch.no_grad():
        first, second = block(*args, **kwargs), block(*args, **kwargs)
    first, second = (o[0] if isinstance(o, tuple) else o for o in (first, second))
    assert torch.equal(first, second)


def test_gptq_gives_the_codes_of_batches_that_turn_the_cache_off_themselves():
    model = _granite()
    recipe = qt.get_preset("gptq4-g64").recipe
    ours = bridge.quantize_params(model, recipe, calibration=CALIB)
    # the reference: each batch tells the inner model not to cache (use_cache reaches it through **kwargs)
    told = bridge.quantize_params(model, recipe, calibration=[{"input_ids": x, "use_cache": False} for x in CALIB])
    quantized = [p for p, q in ours.qtree.items() if isinstance(q, qt.QTensor)]
    assert len(quantized) == 18
    assert [p for p in quantized if not torch.equal(ours.qtree[p].codes, told.qtree[p].codes)] == []


def test_without_cache_replaces_cache_objects_and_turns_use_cache_off():
    cache = tf.DynamicCache()
    mask = torch.ones(2, 3)
    got = without_cache({"past_key_values": cache, "use_cache": True, "attention_mask": mask, "flag": 1})
    assert got == {"past_key_values": None, "use_cache": False, "attention_mask": mask, "flag": 1}
