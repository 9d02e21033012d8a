"""Each block gets its own inputs (issue 51, part 5): on models whose layers differ (sliding-window and full
attention, linear attention or Mamba or short convolutions beside attention), the block-by-block runner hands
every block the keyword inputs that the model's own forward gives it, with the hidden states of the quantized
blocks before it. The reference is a hook on the quantized result itself, independent of the runner's capture."""

import pytest
import torch

import bridge
import qtransform as qt
from bridge.calibrate import find_blocks
from moe.tiny_moe import tiny_hybrid as tiny
from transformers import AutoModelForCausalLM

SPEC = qt.QuantSpec(format="int4", granularity=qt.PerGroup(16))
RECIPE = dict(type_rules={"Linear": SPEC}, exclude=["lm_head*"])
#: layers of two kinds in two blocks: sliding/full attention, linear attention, Mamba-2, short convolutions
DIFFERING = ("gemma3_text", "qwen3_next", "lfm2", "bamba", "nemotron_h", "falcon_h1")
@pytest.fixture
def recorder():
    seen = []

    def fn(params, plan, *, context):
        seen.append((context.block.name, list(context.block.inputs)))
        return qt.Fit()

    qt.register_algorithm("own_recorder", fn, needs=qt.BlockInputs())
    yield seen
    qt.ALGORITHMS.unregister("own_recorder")


def own_inputs(model, batches, plain: bool = False) -> dict:
    """``{block: [(args, kwargs) per batch]}`` by pre-hooks on every block in the model's own forward (a
    transformers model called with ``use_cache=False``, a ``plain`` module with the batch alone)."""
    got = {n: [] for n in find_blocks(model)}
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, k, n=n: got[n].append((a, dict(k))), with_kwargs=True) for n in got]
    with torch.no_grad():
        for b in batches:
            model(b) if plain else model(b, use_cache=False)
    for h in handles:
        h.remove()
    return got


def alike(got, want, where: str) -> None:
    """The runner's inputs against the model's: tensors close (the hidden states: the quantized model's float32
    kernels against the runner's dequantized weights), everything else equal; no cache on either side."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=where)
        else:
            assert torch.equal(got, want), where
    elif isinstance(want, dict):
        keys = {k for k, v in want.items() if v is not None and not type(v).__name__.endswith("Cache")}
        assert keys <= set(got), (where, sorted(keys - set(got)))
        for k in keys:
            alike(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            alike(g, w, f"{where}[{i}]")
    else:
        assert got == want or type(want).__name__.endswith("Cache"), (where, got, want)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", DIFFERING)
def test_every_block_gets_the_inputs_the_model_gives_it(model_type, attn, recorder):
    model = tiny(model_type, attn)
    batches = [torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1)),
               torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(2))]
    qm = bridge.quantize(model, qt.Recipe(**RECIPE, steps=["own_recorder"]), calibration=batches, kernel="dequant")
    want = own_inputs(qm, batches)
    assert [n for n, _ in recorder] == list(want)
    for name, inputs in recorder:
        assert len(inputs) == len(want[name])
        for j, ((a, k), (wa, wk)) in enumerate(zip(inputs, want[name])):
            alike(a, wa, f"{name} batch {j} args")
            alike(k, wk, f"{name} batch {j} kwargs")


def test_the_layers_differ_so_the_test_can_fail():
    """The models above give their blocks different keyword inputs: handing the first block's to all would fail."""
    for model_type in ("gemma3_text", "qwen3_next", "bamba", "lfm2", "nemotron_h"):
        model = tiny(model_type)
        got = own_inputs(model, [torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(3))])
        (_, k0), (_, k1) = got[find_blocks(model)[0]][0], got[find_blocks(model)[1]][0]
        with pytest.raises(AssertionError):
            for key in set(k0) | set(k1):
                alike(k0.get(key), k1.get(key), key)


class _Biased(torch.nn.Module):
    """Blocks whose later inputs come from the first block's output (T5's position bias): a pass-through cannot
    stand in for the first block."""

    class Block(torch.nn.Module):
        def __init__(self, first: bool):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.bias_table = torch.nn.Linear(16, 1) if first else None

        def forward(self, h, bias=None):
            if bias is None:
                bias = self.bias_table(h).tanh()
            return h + self.lin(h) * bias, bias

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList([self.Block(i == 0) for i in range(3)])

    def forward(self, ids):
        h, bias = self.emb(ids), None
        for layer in self.layers:
            h, bias = layer(h, bias=bias)
        return h


def test_inputs_made_by_earlier_blocks_come_from_the_real_blocks(recorder):
    torch.manual_seed(0)
    model = _Biased().eval()
    batches = [torch.randint(0, 32, (2, 5)), torch.randint(0, 32, (1, 7))]
    bridge.quantize(model, qt.Recipe(type_rules={"Linear": SPEC}, steps=["own_recorder"]), calibration=batches)
    want = own_inputs(model, batches, plain=True)
    for name, inputs in recorder[1:]:
        for (a, k), (wa, wk) in zip(inputs, want[name]):
            torch.testing.assert_close(k["bias"], wk["bias"])  # the float first block's bias, not None


class _Scaled(_Biased):
    """A model that changes the hidden states between its blocks: pass-throughs cannot show the blocks' inputs."""

    def forward(self, ids):
        h, bias = self.emb(ids), None
        for layer in self.layers:
            h, bias = layer(h, bias=bias)
            h = h * 0.5
        return h


def test_blocks_a_streamed_run_cannot_record_are_refused_by_name(recorder):
    from bridge.calibrate.own_inputs import Unfaithful, capture_blocks

    torch.manual_seed(0)
    model = _Scaled().eval()
    names = find_blocks(model)
    batches = [torch.randint(0, 32, (1, 5)), torch.randint(0, 32, (2, 3))]
    with torch.device("meta"):
        skeleton = _Scaled().eval()
    first = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith(("layers.1.", "layers.2."))}
    with pytest.raises(Unfaithful, match="_Scaled: its blocks do not pass their hidden states"):
        capture_blocks(skeleton, first, names, batches, real=False)
    # in memory the blocks run instead: the inputs are the model's own
    bridge.quantize(model, qt.Recipe(type_rules={"Linear": SPEC}, steps=["own_recorder"]), calibration=batches)
    want = own_inputs(model, batches, plain=True)
    for name, inputs in recorder[1:]:
        for (a, k), (wa, wk) in zip(inputs, want[name]):
            torch.testing.assert_close(k["bias"], wk["bias"])


@pytest.mark.parametrize("model_type", ["gemma3_text", "bamba"])
def test_a_streamed_run_hands_each_block_the_same_inputs(model_type, recorder, tmp_path):
    from bridge.stream import quantize_checkpoint

    tiny(model_type).save_pretrained(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()  # as the stream builds it
    batches = [torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(4))]
    recipe = qt.Recipe(**RECIPE, steps=["own_recorder"])
    bridge.quantize(model, recipe, calibration=batches, kernel="dequant")
    memory = list(recorder)
    recorder.clear()
    quantize_checkpoint(tmp_path / "src", tmp_path / "out", recipe, calibration=batches)
    assert [n for n, _ in recorder] == [n for n, _ in memory]
    for (name, streamed), (_, held) in zip(recorder, memory):
        for (a, k), (wa, wk) in zip(streamed, held):
            alike(a, wa, f"{name} args")
            alike(k, wk, f"{name} kwargs")
