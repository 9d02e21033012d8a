"""``quantize_checkpoint`` inside a real ``torch.distributed`` group (2 gloo ranks, separate processes) writes
the very bytes of the one-process streamed run: block by block (GPTQ; static int8 activations, their
statistics reduced over the ranks), shard to shard (HQQ, its tensors split among the ranks); rank 0 alone
writes, the other ranks' scratch goes away; a run that failed mid-way resumes, each rank from its own share.
One process group runs it all (module fixture); the tests read what it left."""

from __future__ import annotations

import pytest
import torch

import tiny_lm
from stream_ranks import everything, run_ranks, written

SHARDS = {"max_shard_size": "40KB"}
#: (preset, calibrated, every rank given the same out, options): GPTQ with every stream spilled to disk (the
#: ranks' spills and snapshots in one work directory), static activations, shard to shard
CASES = (("gptq4-g64", True, True, {"max_memory": 1, **SHARDS}), ("w8a8-int8", True, False, SHARDS),
         ("hqq4-g64", False, False, SHARDS))


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tiny_lm.WORDS) + 2, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    root = tmp_path_factory.mktemp("dist-stream")
    LlamaForCausalLM(cfg).eval().to(torch.bfloat16).save_pretrained(root / "src", max_shard_size="60KB")
    tiny_lm.tokenizer().save_pretrained(root / "src")
    results = run_ranks(2, everything, root / "src", root, CASES, "gptq4-g64", 2, SHARDS)
    return root, results


@pytest.mark.parametrize("preset", [c[0] for c in CASES])
def test_two_ranks_write_the_bytes_of_one_process(ran, preset):
    root, results = ran
    one, two = written(root / f"{preset}-one"), written(root / preset)
    assert sorted(two) == sorted(one) and "model.safetensors.index.json" in two
    assert [f for f in one if one[f] != two[f]] == []  # every file, every tensor: bit-identical
    assert not (root / f".{preset}.partial").exists()
    (mode, size, acts), other = results[0][0][preset], results[1][0][preset]
    assert other == (mode, size, acts)  # every rank holds the same result (the activation scales included)
    assert mode == ("shard to shard" if preset == "hqq4-g64" else "block by block")
    assert size == sum(len(b) for f, b in two.items() if f.endswith(".safetensors"))
    assert bool(acts) == (preset == "w8a8-int8")  # static activation scales, reduced over the ranks


def test_only_rank_0_writes_and_the_others_remove_their_scratch(ran):
    root, _ = ran
    assert [p.name for p in (root / "rank1").iterdir()] == []  # given their own out: nothing there, no scratch


def test_a_run_that_failed_mid_way_resumes_on_two_ranks_to_the_same_bytes(ran):
    root, results = ran
    done, refused, resumed = results[0][1]
    assert sorted(done) == ["block 0", "block 1"]
    assert refused is not None and "ranks" in refused  # one process cannot take over two ranks' shares
    assert resumed == 2 and results[1][1][2] == 2
    assert written(root / "resumed") == written(root / "gptq4-g64-one")
    assert not (root / ".resumed.partial").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (make test-gpu on a GPU machine)")
def test_two_ranks_with_the_block_on_cuda_write_the_bytes_of_one_process_on_cuda(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tiny_lm.WORDS) + 2, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).eval().to(torch.bfloat16).save_pretrained(tmp_path / "src")
    cases = tuple((preset, True, True, {"device": "cuda"}) for preset in ("gptq4-g64", "fp8-w8a8-kv"))
    run_ranks(2, everything, tmp_path / "src", tmp_path, cases, "gptq4-g64", 1, {"device": "cuda"})
    for preset, *_ in cases:
        assert written(tmp_path / preset) == written(tmp_path / f"{preset}-one")
    assert written(tmp_path / "resumed") == written(tmp_path / "gptq4-g64-one")
