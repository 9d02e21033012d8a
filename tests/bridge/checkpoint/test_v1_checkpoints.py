"""Checkpoints written by qtransform 0.1.0 (metadata version 1) keep loading with identical logits.

The fixtures in tests/fixtures/v1 were written by main@20f39f2, before the metadata moved to
version 2: round to nearest and HQQ, every format family, GPT-2's Conv1D with calibration
choices (mse and percentile observers) stored in the specs, tied embeddings written by
``save_pretrained``. Each ``<name>.expected.safetensors`` holds input ids and the logits of the
in-memory quantized model that wrote it. Against those the logits must agree to float precision (1e-6 of
their largest magnitude: a newer transformers may order a kernel's operations differently, 1.8e-7 measured
with 5.23); the two loaders give bit-identical logits.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import bridge
import qtransform as qt

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "v1"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


def test_fixtures_present():
    assert NAMES == ["gpt2-observers", "llama-formats", "llama-hqq4-g64", "llama-int4-g32",
                     "llama-tied-save-pretrained"]


@pytest.fixture(autouse=True)
def kernels_of_the_fixtures(monkeypatch):
    """The int4 fixtures' logits came from ``_weight_int4pack_mm_for_cpu`` (bf16) at every token count:
    the same kernel must give the same bits. Later paths (the decode GEMV up to ``DECODE_MAX_ROWS``
    tokens, dequantize + GEMM from ``PREFILL_ROWS``) round differently, by design."""
    from bridge.kernels import decode, dense

    monkeypatch.setattr(decode, "DECODE_MAX_ROWS", 0)
    monkeypatch.setitem(dense.PREFILL_ROWS, "int4pack_cpu", None)


def _same(logits, stored):
    torch.testing.assert_close(logits, stored, rtol=0, atol=1e-6 * float(stored.abs().max()))


def _from_pretrained(name, ids):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", NAMES)
def test_from_pretrained_same_logits(name):
    expected = load_file(str(FIXTURES / f"{name}.expected.safetensors"))
    _same(_from_pretrained(name, expected["input_ids"]), expected["logits"])


@pytest.mark.parametrize("name", NAMES)
def test_bridge_load_same_logits(name):
    expected = load_file(str(FIXTURES / f"{name}.expected.safetensors"))
    cfg = AutoConfig.from_pretrained(FIXTURES / name)
    cfg.quantization_config = None
    like = AutoModelForCausalLM.from_config(cfg).eval()
    model = bridge.load(FIXTURES / name, like=like).eval()
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    _same(logits, expected["logits"])
    assert torch.equal(logits, _from_pretrained(name, expected["input_ids"]))  # both loaders: one model


@pytest.mark.parametrize("name", NAMES)
def test_load_tree_needs_no_model_and_upgrades_the_metadata(name):
    tree = bridge.load_tree(FIXTURES / name)
    meta = bridge.read_metadata(FIXTURES / name)
    assert meta.version == 1 and set(meta.entries) == {p for p, v in tree.items() if isinstance(v, qt.QTensor)}
    for path, e in meta.entries.items():
        assert tree[path].spec == e.spec and tuple(tree[path].shape) == e.shape
    specs = {p: e.spec for p, e in meta.entries.items()}
    if name == "gpt2-observers":  # calibration choices of version 1 are gone from the specs, the tensors load
        assert specs["transformer.h.0.attn.c_attn.weight"] == qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    if name == "llama-hqq4-g64":  # version 1's algorithm and options are the recipe's step
        assert meta.recipe.steps == (qt.Step("hqq", error_norm=4.0, refine_scale=False),)


def test_resaving_writes_version_2(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama-hqq4-g64").eval()
    model.save_pretrained(tmp_path / "v2")
    meta = bridge.read_metadata(tmp_path / "v2")
    assert meta.version == 2 and meta.recipe.steps == (qt.Step("hqq", error_norm=4.0, refine_scale=False),)
    text = (tmp_path / "v2" / "config.json").read_text()
    assert '"observer"' not in text and '"histogram_bins"' not in text and '"algorithm"' not in text
    expected = load_file(str(FIXTURES / "llama-hqq4-g64.expected.safetensors"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "v2").eval()
    with torch.no_grad():
        _same(back(expected["input_ids"]).logits, expected["logits"])


def test_upgrade_keeps_one_observer_choice_as_the_rtn_step():
    from bridge.checkpoint import metadata

    d = json.loads((FIXTURES / "gpt2-observers" / "config.json").read_text())["quantization_config"]
    mixed = metadata.upgrade(d)  # mse, percentile and minmax rules: no single step expresses them
    assert "steps" not in mixed["recipe"]
    for _, spec in d["recipe"]["rules"] + d["recipe"]["type_rules"]:
        spec.update(observer="percentile", percentile=99.5, histogram_bins=512)
    same = metadata.upgrade(d)
    assert same["recipe"]["steps"] == [{"name": "rtn", "options": {
        "observer": {"name": "percentile", "bins": 512, "percentile": 99.5}}}]
    steps = qt.Recipe.from_dict(same["recipe"]).steps
    assert steps == (qt.Step("rtn", observer={"name": "percentile", "bins": 512, "percentile": 99.5}),)
    qt.check_steps(steps)  # a valid rtn option: the observer it names exists with those options
