"""``qtransform quantize --to quark`` and ``qtransform export --to quark``, and their refusals."""

import json

import torch
from cli_util import main_cli
from interop.quark.helpers import same_bits, stored


# ---------------------------------------------------------------------------------------------- the command
def test_cli_quantize_to_quark_and_export(tiny_llama_dir, tmp_path):
    out = tmp_path / "ckpt"
    res = main_cli("quantize", "--model", str(tiny_llama_dir), "--recipe", "int4-g32-asym", "--no-eval", "--out", str(out),
                   "--to", "quark")
    assert res.returncode == 0, res.stderr
    exported = tmp_path / "ckpt-quark"
    cfg = json.loads((exported / "config.json").read_text())
    qcfg = cfg["quantization_config"]
    assert qcfg["quant_method"] == "quark" and qcfg["global_quant_config"]["weight"]["dtype"] == "uint4"
    assert qcfg["exclude"] == ["lm_head"] and qcfg["export"]["pack_method"] == "reorder"  # tied, not quantized
    assert (exported / "tokenizer.json").is_file() and (exported / "generation_config.json").is_file()
    files = stored(exported)
    assert files["model.layers.0.mlp.down_proj.weight"].dtype == torch.int32
    assert files["model.layers.0.mlp.down_proj.weight"].shape == (128, 64 // 8)  # (in, out / 8): transposed

    res = main_cli("export", str(out), "--to", "quark", "--out", str(tmp_path / "again"))
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout and stored(tmp_path / "again").keys() == files.keys()
    assert all(same_bits(v, files[k]) for k, v in stored(tmp_path / "again").items())


def test_cli_refuses_an_inexpressible_spec(tiny_llama_dir, tmp_path):
    res = main_cli("quantize", "--model", str(tiny_llama_dir), "--recipe", "nvfp4", "--no-eval", "--out",
                   str(tmp_path / "nv"), "--to", "quark")
    assert res.returncode != 0 and "model.layers.0.self_attn.q_proj.weight" in res.stderr, res.stderr
    assert "--to quark cannot hold" in res.stderr and not (tmp_path / "nv").exists()
    from transformers import AutoModelForCausalLM

    import bridge
    import qtransform as qt
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    bridge.save(bridge.quantize(model, qt.get_preset("nvfp4").recipe), tmp_path / "nv")
    res = main_cli("export", str(tmp_path / "nv"), "--to", "quark", "--out", str(tmp_path / "nv-quark"))
    assert res.returncode != 0 and "model.layers.1.mlp.up_proj.weight: nvfp4" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "nv-quark").exists()
