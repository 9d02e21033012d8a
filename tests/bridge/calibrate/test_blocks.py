"""Block-by-block calibration: the blocks of every architecture, each block's inputs as the quantized
blocks before it make them (checked against hooks on a model quantized independently), steps that
change a block's weights, statistics inside a block."""

import copy

import pytest
import torch

import bridge
import qtransform as qt
from bridge.calibrate import find_blocks
from bridge_util import hidden_into, tiny_causal_lm

SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
RECIPE = qt.Recipe(type_rules={"Linear": SPEC}, exclude=["lm_head*"])
BLOCKS = {"llama": "model.layers", "mistral": "model.layers", "qwen2": "model.layers", "opt": "model.decoder.layers",
          "gpt2": "transformer.h", "bert": "bert.encoder.layer"}


@pytest.mark.parametrize("arch", sorted(BLOCKS))
def test_the_repeated_blocks_of_every_architecture(arch):
    assert find_blocks(tiny_causal_lm(arch)) == (f"{BLOCKS[arch]}.0", f"{BLOCKS[arch]}.1")


def test_a_model_without_repeated_blocks_is_named():
    with pytest.raises(ValueError, match="Sequential has no repeated blocks"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))


@pytest.fixture
def recorder():
    """A BlockInputs step that records each block it is handed (and may shrink its weights)."""
    seen = []

    def fn(params, plan, *, context, factor=1.0):
        b = context.block
        seen.append((b.name, b.paths, [args[0].clone() if args else None for args, _ in b.inputs], b))
        if factor == 1.0:
            return qt.Fit()
        return qt.Fit(params={p: params[p] * factor for p in b.paths if p in plan.specs})

    qt.register_algorithm("recorder", fn, needs=qt.BlockInputs())
    yield seen
    qt.ALGORITHMS.unregister("recorder")


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
def test_each_block_gets_the_outputs_of_the_quantized_blocks_before_it(arch, recorder):
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval()
    batches = [torch.randint(0, 128, (2, 6)), torch.randint(0, 128, (1, 9))]
    qm = bridge.quantize(model, qt.Recipe(type_rules={"Linear": SPEC, "Conv1D": SPEC}, exclude=["lm_head*"],
                                          steps=["recorder"]), calibration=batches, kernel="dequant")
    names = [n for n, *_ in recorder]
    assert names == list(find_blocks(model))
    # block 0 sees the float model's hidden states; block 1 those of block 0 quantized by round to nearest
    ref0 = hidden_into(model, names[0], batches)
    ref1 = hidden_into(qm, names[1], batches)  # the result (float32 reference kernel): round to nearest
    for got, want in zip(recorder[0][2], ref0):
        torch.testing.assert_close(got, want)
    for got, want in zip(recorder[1][2], ref1):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert all(p.startswith(names[1] + ".") for p in recorder[1][1])
    rtn = bridge.quantize(model, qt.Recipe(type_rules={"Linear": SPEC, "Conv1D": SPEC}, exclude=["lm_head*"]),
                          kernel="dequant")
    ids = batches[0]
    with torch.no_grad():
        assert torch.equal(qm(ids).logits, rtn(ids).logits)  # a step that fits nothing changes nothing


def test_a_block_step_changes_its_weights_and_the_next_block_sees_them(recorder):
    torch.manual_seed(1)
    model = tiny_causal_lm("llama").eval()
    batches = [torch.randint(0, 128, (2, 7))]
    recipe = qt.Recipe(type_rules={"Linear": SPEC}, exclude=["lm_head*"], steps=[qt.Step("recorder", factor=0.5)])
    r = bridge.quantize_params(model, recipe, calibration=batches)
    w = model.model.layers[1].mlp.up_proj.weight.detach() * 0.5
    assert torch.equal(r.qtree["model.layers.1.mlp.up_proj.weight"].codes, qt.quantize(w, qt.choose_qparams(w, SPEC)).codes)
    # the reference for block 1's inputs: block 0 halved, then quantized, in a copy of the model
    ref = copy.deepcopy(model)
    for name, m in ref.model.layers[0].named_modules():
        if isinstance(m, torch.nn.Linear):
            with torch.no_grad():
                h = m.weight * 0.5
                m.weight.copy_(qt.dequantize(qt.quantize(h, qt.choose_qparams(h, SPEC))))
    for got, want in zip(recorder[1][2], hidden_into(ref, "model.layers.1", batches)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_run_and_site_statistics_inside_a_block(recorder):
    torch.manual_seed(2)
    model = tiny_causal_lm("llama").eval()
    batches = [torch.randint(0, 128, (2, 5))]
    bridge.quantize_params(model, qt.Recipe(type_rules={"Linear": SPEC}, steps=["recorder"]), calibration=batches)
    block = recorder[0][3]
    params = bridge.extract(model)
    out = block.run({})  # the block on its inputs with the current tensors
    with torch.no_grad():
        args, kwargs = block.inputs[0]
        want = model.model.layers[0](*args, **kwargs)
    torch.testing.assert_close(bridge.calibrate.first_tensor(out[0]), bridge.calibrate.first_tensor(want))
    site = qt.Site("model.layers.0.self_attn.q_proj")
    stats = block.site_stats({}, {site: qt.init_stats(observer="channel")})
    x = hidden_into(model, "model.layers.0", batches)[0]
    normed = model.model.layers[0].input_layernorm(x)
    torch.testing.assert_close(qt.finalize_stats(stats[site]).absmax, normed.reshape(-1, 64).abs().amax(0))
    changed = block.run({"model.layers.0.mlp.down_proj.weight": params["model.layers.0.mlp.down_proj.weight"] * 0})
    assert not torch.allclose(bridge.calibrate.first_tensor(changed[0]), bridge.calibrate.first_tensor(out[0]))


def test_block_steps_need_calibration_and_stay_inside_their_block():
    model = tiny_causal_lm("llama").eval()
    qt.register_algorithm("greedy", lambda params, plan, *, context: qt.Fit(
        params={"model.layers.1.mlp.up_proj.weight": params["model.layers.1.mlp.up_proj.weight"]}),
        needs=qt.BlockInputs())
    try:
        recipe = qt.Recipe(type_rules={"Linear": SPEC}, steps=["greedy"])
        with pytest.raises(ValueError, match="'greedy' runs block by block on calibration data"):
            bridge.quantize(model, recipe)
        with pytest.raises(ValueError, match=r"block model.layers.0: returned tensors outside the block"):
            bridge.quantize(model, recipe, calibration=[torch.randint(0, 128, (1, 4))])
        with pytest.raises(ValueError, match="runs block by block"):
            qt.get_algorithm("greedy")(bridge.extract(model), SPEC)
    finally:
        qt.ALGORITHMS.unregister("greedy")


def test_tuple_batches_carry_no_key_value_cache_between_runs(recorder):
    torch.manual_seed(4)
    model = tiny_causal_lm("llama").eval()
    ids = torch.randint(0, 128, (2, 6))
    bridge.quantize_params(model, qt.Recipe(type_rules={"Linear": SPEC}, steps=["recorder"]), calibration=[(ids,)])
    block = recorder[0][3]
    v = "model.layers.0.self_attn.v_proj.weight"
    first, again = block.run({}), block.run({})
    torch.testing.assert_close(first[0][0] if isinstance(first[0], tuple) else first[0],
                               again[0][0] if isinstance(again[0], tuple) else again[0])
    zeroed = block.run({v: torch.zeros_like(model.get_parameter(v))})  # attention must read the new values
    assert not torch.allclose(bridge.calibrate.first_tensor(zeroed[0]), bridge.calibrate.first_tensor(first[0]))
    _, kwargs = block.inputs[0]
    assert not any(type(x).__name__.endswith("Cache") for x in kwargs.values() if x is not None)


class _Hybrid(torch.nn.Module):
    """Layers of two classes, the second holding a list of experts run side by side."""

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, h):
            return h + self.proj(h)

    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))

        def forward(self, h):
            return h + sum(e(h) for e in self.experts) / 3

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([self.Attn(), self.MoE(), self.Attn(), self.MoE()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_hybrid_layers_are_the_blocks_not_the_experts():
    model = _Hybrid()
    assert find_blocks(model) == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert find_blocks(model, "layers.1.experts") == ("layers.1.experts.0", "layers.1.experts.1", "layers.1.experts.2")
    with pytest.raises(ValueError, match=r"blocks='layers.9' is not a non-empty nn.ModuleList of _Hybrid"):
        find_blocks(model, "layers.9")
    with pytest.raises(ValueError, match=r"blocks='layers.0' is not a non-empty nn.ModuleList"):
        bridge.ModelCalibrator(model, [torch.ones(1, 32)], blocks="layers.0")


def test_blocks_are_quantized_with_what_earlier_steps_fitted(recorder):
    """hqq then a block step: the next block's inputs come from the HQQ-quantized block, not round to nearest."""
    torch.manual_seed(5)
    model = tiny_causal_lm("llama").eval()
    batches = [torch.randint(0, 128, (2, 6))]
    hqq_spec = qt.QuantSpec(format="uint3", granularity=qt.PerGroup(32), symmetric=False, zero_point_domain="float",
                            scale_dtype="float16")
    recipe = qt.Recipe(type_rules={"Linear": hqq_spec}, exclude=["lm_head*"], steps=[qt.Step("hqq", iters=10),
                                                                                     "recorder"])
    r = bridge.quantize_params(model, recipe, calibration=batches)
    ref = copy.deepcopy(model)  # block 0 as HQQ quantized it, computed from the result
    for name, m in ref.model.layers[0].named_modules():
        if isinstance(m, torch.nn.Linear):
            with torch.no_grad():
                m.weight.copy_(qt.dequantize(r.qtree[f"model.layers.0.{name}.weight"]))
    for got, want in zip(recorder[1][2], hidden_into(ref, "model.layers.1", batches)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_batch_counts_the_rows_of_its_hidden_states():
    from bridge.calibrate.blocks import batch_tokens  # the one count: the core takes it as Block.tokens

    mask, h = torch.zeros(2, 1, 8, 8), torch.zeros(2, 8, 16)
    assert batch_tokens((h, mask), {}) == 16  # the first positional tensor
    assert batch_tokens((), {"attention_mask": mask, "hidden_states": h}) == 16  # else the hidden_states keyword
    assert batch_tokens((), {"x": torch.zeros(7, 4), "y": h}) == 7  # else the first tensor keyword
    assert batch_tokens((), {"n": 3}) == 0
