"""``qtransform quantize --stream`` writes the very bytes of the in-memory run, on every architecture we name,
for steps without data (shard to shard) and with data (block by block), from bf16 and float32 inputs."""

from __future__ import annotations

import json

import pytest
import torch
from stream_util import digests, in_memory, quantize, save_tiny, stored_dtype

ARCHS = ("llama", "mistral", "qwen2", "phi3", "opt", "gpt2", "bert")
#: (preset, extra options): shard to shard, a local step, block by block, chains, static activations, KV cache
CASES = {"int4-g128": (), "hqq4-g64": (), "gptq4-g64": ("--calib", "4", "--calib-batch", "2"),
         "awq-gptq4-g128": ("--calib", "2", "--calib-batch", "1"), "gptq-w8a8": ("--calib", "3", "--calib-batch", "2"),
         "fp8-w8a8-kv": ("--calib", "2", "--calib-batch", "2"),
         "quarot-w4a8": ("--calib", "2", "--calib-batch", "1"), "quarot-w4a4": ("--calib", "2", "--calib-batch", "1"),
         "quarot-kv": ("--calib", "2", "--calib-batch", "1", "--kv-cache", "fp8_e4m3")}
#: every architecture with a data-free preset and GPTQ; the heavier chains on two
MATRIX = [(a, p) for a in ARCHS for p in ("int4-g128", "gptq4-g64")] + \
    [("llama", "hqq4-g64"), ("gpt2", "hqq4-g64"), ("llama", "awq-gptq4-g128"), ("qwen2", "gptq-w8a8"),
     ("opt", "gptq-w8a8"), ("llama", "fp8-w8a8-kv"), ("phi3", "awq-gptq4-g128"), ("llama", "quarot-w4a8"),
     ("qwen2", "quarot-w4a4"), ("mistral", "quarot-kv"), ("phi3", "quarot-w4a8")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-src")
    return {arch: save_tiny(arch, root / arch) for arch in ARCHS}


@pytest.mark.parametrize("arch,preset", MATRIX, ids=[f"{a}-{p}" for a, p in MATRIX])
def test_streamed_checkpoint_has_the_bytes_of_the_in_memory_one(arch, preset, sources, tmp_path):
    extra = CASES[preset]
    preset = "quarot-w4a8" if preset == "quarot-kv" else preset  # with a key/value cache: R3 on the keys
    in_memory = quantize(sources[arch], tmp_path / "memory", preset, "--no-eval", *extra)
    streamed = quantize(sources[arch], tmp_path / "stream", preset, "--no-eval", "--stream", "--layer-errors", *extra)
    assert digests(tmp_path / "stream") == digests(tmp_path / "memory")
    assert streamed["streamed"] and not in_memory["streamed"]
    errors = {r["path"]: r["rel_error"] for r in in_memory["layers"]}
    assert errors and {r["path"]: r["rel_error"] for r in streamed["layers"]} == errors  # the same floats, the same math
    assert streamed["peak_memory"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_rotation_without_data_streams_block_by_block_to_the_same_bytes(arch, sources, tmp_path):
    import qtransform as qt
    from bridge.stream import quantize_checkpoint

    recipe = qt.Recipe(type_rules={"Linear": qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))},
                       exclude=["lm_head*"], steps=[qt.Step("rotate"), qt.Step("rtn")])
    done = quantize_checkpoint(sources[arch], tmp_path / "s", recipe, max_shard_size="30KB")
    in_memory(sources[arch], tmp_path / "m", recipe, max_shard_size="30KB")
    assert done.written.mode == "block by block" and done.online  # R4 before every down projection
    assert digests(tmp_path / "s") == digests(tmp_path / "m")
    assert len([f for f in digests(tmp_path / "s") if f.endswith(".safetensors")]) > 2


def test_quantized_embeddings_with_static_activations_stream_to_the_same_bytes(sources, tmp_path):
    """The static activations' pass starts from the quantized embeddings, the block-by-block steps' from the
    float ones: both streams are captured from the prefix."""
    import qtransform as qt
    from bridge.stream import quantize_checkpoint

    int8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    recipe = qt.Recipe(type_rules={"Linear": int8, "Embedding": int8}, exclude=["lm_head*"], steps=[qt.Step("gptq")],
                       input=qt.QuantSpec(format="int8"))
    batches = [torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    quantize_checkpoint(sources["llama"], tmp_path / "s", recipe, calibration=batches)
    in_memory(sources["llama"], tmp_path / "m", recipe, calibration=batches)
    assert digests(tmp_path / "s") == digests(tmp_path / "m")


def test_the_float_tensors_keep_their_stored_dtype_and_the_checkpoint_loads(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    quantize(sources["llama"], tmp_path / "q", "int4-g128", "--no-eval", "--stream")
    assert stored_dtype(tmp_path / "q", "model.embed_tokens.weight") == torch.bfloat16
    assert json.loads((tmp_path / "q" / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert model.dtype == torch.bfloat16
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QLinear"
    ids = torch.tensor([[1, 5, 9, 2]])
    out = model.generate(ids, max_new_tokens=1, do_sample=False)
    assert out.shape == (1, 5)


@pytest.mark.parametrize("dtype,preset", [(torch.float16, "nvfp4"), (torch.float32, "mxfp4"),
                                          (torch.float16, "gptq4-g64")])
def test_fp16_and_fp32_inputs_single_file_or_sharded(dtype, preset, tmp_path):
    src = save_tiny("qwen2", tmp_path / "src", dtype=dtype, shard="10GB" if dtype == torch.float32 else "30KB")
    extra = ("--calib", "2", "--calib-batch", "1") if preset.startswith("gptq") else ()
    quantize(src, tmp_path / "m", preset, "--no-eval", *extra)
    quantize(src, tmp_path / "s", preset, "--no-eval", "--stream", *extra)
    assert digests(tmp_path / "s") == digests(tmp_path / "m")
    assert stored_dtype(tmp_path / "s", "model.norm.weight") == dtype


def test_a_quantized_checkpoint_is_refused_by_name(sources, tmp_path, capsys):
    from bridge.app.cli import main

    quantize(sources["llama"], tmp_path / "q", "int4-g128", "--no-eval")
    rc = main(["quantize", "--model", str(tmp_path / "q"), "--out", str(tmp_path / "o"), "--stream", "--no-eval"])
    assert rc == 1 and "quantized checkpoint" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_dtype_float32_stores_everything_in_float32(sources, tmp_path):
    quantize(sources["gpt2"], tmp_path / "a", "int4-g128", "--no-eval", "--stream", "--dtype", "float32")
    quantize(sources["gpt2"], tmp_path / "b", "int4-g128", "--no-eval", "--dtype", "float32")
    assert digests(tmp_path / "a") == digests(tmp_path / "b")
    assert stored_dtype(tmp_path / "a", "transformer.wte.weight") == torch.float32
    assert stored_dtype(tmp_path / "a", "transformer.ln_f.weight") == torch.float32


def test_a_streamed_run_evaluates_the_quantized_checkpoint(sources, tmp_path):
    rep = quantize(sources["llama"], tmp_path / "q", "int4-g128", "--stream", "--no-layer-errors")
    memory = quantize(sources["llama"], tmp_path / "m", "int4-g128")
    # the original's perplexity from the float model loaded whole (it fits), as the in-memory run measures it
    assert rep["ppl_before"] == pytest.approx(memory["ppl_before"], rel=1e-6) and rep["ppl_after"] > 1
    assert rep["layers"] and all(r["rel_error"] is None for r in rep["layers"]) and rep["mean_rel_error"] is None
