"""The inventory of the input (issue 51, part 1): stored tensors that the model class does not load (multi-token
prediction layers) are carried into the output unchanged by the command, in memory and streamed, with a line in
the report; an output lacking any input tensor is refused by name before it appears. The expected tensors are
read from the input's own file, not from the code under test."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import bridge
import tiny_lm
from bridge.checkpoint import CheckpointError
from bridge.stream.inventory import take, written_names
from cli_util import main_cli
from moe.tiny_moe import build_tiny_moe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
IDS = torch.tensor([[1, 5, 9, 2, 17, 3, 30, 4, 11, 7]])


def with_mtp(model_type: str, directory: Path, extra) -> dict:
    """A tiny ``model_type`` checkpoint with ``extra(hidden, layers)`` tensors added to its file (as the
    released checkpoints carry their MTP layers); returns the added tensors."""
    model = build_tiny_moe(model_type)
    model.save_pretrained(directory)
    tiny_lm.tokenizer().save_pretrained(directory)
    added = extra(model.config.hidden_size, model.config.num_hidden_layers)
    stored = load_file(directory / "model.safetensors")
    save_file({**stored, **added}, directory / "model.safetensors", metadata={"format": "pt"})
    return added


def qwen_mtp(h, n):
    g = torch.Generator().manual_seed(5)
    return {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g).to(torch.bfloat16),
            "mtp.layers.0.input_layernorm.weight": torch.rand(h, generator=g) + 0.5,
            "mtp.pre_fc_norm_embedding.weight": torch.rand(h, generator=g).to(torch.float16)}


def deepseek_mtp(h, n):
    g = torch.Generator().manual_seed(6)
    return {f"model.layers.{n}.eh_proj.weight": torch.randn(h, 2 * h, generator=g),
            f"model.layers.{n}.enorm.weight": torch.rand(h, generator=g).to(torch.bfloat16)}


@pytest.mark.parametrize("driver", ["--in-memory", "--stream"])
@pytest.mark.parametrize("model_type,extra", [("qwen3_next", qwen_mtp), ("deepseek_v3", deepseek_mtp)])
def test_tensors_the_model_does_not_load_survive_the_command(model_type, extra, driver, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    added = with_mtp(model_type, src, extra)
    res = main_cli("quantize", "--model", src, "--recipe", "int4-g32", "--out", out, "--no-eval", driver)
    assert res.returncode == 0, res.stderr
    got = {}
    for f in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values() \
            if (out / "model.safetensors.index.json").is_file() else ["model.safetensors"]:
        got.update(load_file(out / f))
    for name, t in added.items():  # as stored: dtype and bytes
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    report = json.loads((out / "report.json").read_text())
    assert any(f"kept as stored: {len(added)} tensor(s)" in n for n in report["notes"]), report["notes"]
    # the checkpoint loads with the extra tensors in it, to the logits of the model quantized in memory
    from transformers import AutoModelForCausalLM

    from bridge.app import models

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    float_model = models.load_causal_lm(src)
    want = bridge.quantize(float_model, bridge.app.inputs.load_recipe("int4-g32").recipe)
    again = bridge.load(out, like=float_model)  # the library's loader too: the carried names are recorded
    assert json.loads((out / "config.json").read_text())["quantization_config"]["carried"] == sorted(added)
    with torch.no_grad():
        for m in (reloaded, again):
            torch.testing.assert_close(m(IDS).logits, want(IDS).logits, rtol=1e-4, atol=1e-4)


def test_both_drivers_write_the_same_carried_tensors(tmp_path):
    src = tmp_path / "src"
    with_mtp("qwen3_next", src, qwen_mtp)
    for driver in ("--in-memory", "--stream"):
        res = main_cli("quantize", "--model", src, "--recipe", "int4-g32", "--out", tmp_path / driver, "--no-eval",
                       driver)
        assert res.returncode == 0, res.stderr
    a, b = load_file(tmp_path / "--in-memory" / "model.safetensors"), load_file(tmp_path / "--stream" / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_the_inventory_gives_each_stored_tensor_a_fate(tmp_path):
    src = tmp_path / "src"
    added = with_mtp("qwen3_next", src, qwen_mtp)
    from bridge.app import models

    model = models.load_causal_lm(src)
    inv = take(src, model)
    stored = set(load_file(src / "model.safetensors"))
    assert set(inv.carried) == set(added)
    assert set(inv.loaded) | set(inv.carried) == stored
    state = model.state_dict()
    assert all(inv.loaded[n] in state for n in inv.loaded)


def test_an_output_lacking_an_input_tensor_is_refused_by_name(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    with_mtp("deepseek_v3", src, deepseek_mtp)
    from bridge.app import models

    model = models.load_causal_lm(src)
    inv = take(src, model)
    bridge.save(model, out, carried={n: inv.read(n) for n in inv.carried})
    inv.check(out)  # all there
    stored = load_file(out / "model.safetensors")
    lost = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert lost in stored
    save_file({n: t for n, t in stored.items() if n != lost}, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"the output lacks 1 tensor\(s\) of the input .*kv_a_proj_with_mqa"):
        inv.check(out)
    assert lost not in written_names(out)


@pytest.mark.parametrize("driver", ["--in-memory", "--stream"])
def test_an_export_that_cannot_carry_them_is_refused_before_anything_is_written(driver, tmp_path):
    src = tmp_path / "src"
    with_mtp("deepseek_v3", src, deepseek_mtp)
    res = main_cli("quantize", "--model", src, "--recipe", "int4-g32", "--out", tmp_path / "out", "--no-eval", driver,
                   "--to", "gguf")
    assert res.returncode != 0 and "--to gguf cannot hold the 2 tensor(s) of the input" in res.stderr, res.stderr
    assert "model.layers.2.eh_proj.weight" in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("driver", ["--in-memory", "--stream"])
def test_a_rule_selecting_a_carried_tensor_is_refused_by_name(driver, tmp_path):
    """Carried tensors are written as stored: a glob rule naming one (which no module holds) is refused, not ignored."""
    src = tmp_path / "src"
    with_mtp("qwen3_next", src, qwen_mtp)
    recipe = tmp_path / "r.json"
    int4 = {"format": "int4", "granularity": {"type": "PerGroup", "size": 32}}
    recipe.write_text(json.dumps({"type_rules": {"Linear": int4}, "rules": {"mtp.*.weight": int4},
                                  "exclude": ["lm_head*"]}))
    res = main_cli("quantize", "--model", src, "--recipe", recipe, "--out", tmp_path / "out", "--no-eval", driver)
    assert res.returncode != 0, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "recipe rules[mtp.*.weight] selects a tensor the model class does not load" in line, res.stderr
    assert any(f"{n}: recipe" in line for n in qwen_mtp(4, 1)), line  # the carried tensor, by name
    assert not (tmp_path / "out").exists()
