"""``qtransform quantize --stream`` on mixture-of-experts checkpoints as ``save_pretrained`` writes them (and as
every MoE checkpoint on the Hub is): experts stored one by one (Mixtral ``block_sparse_moe.experts.3.w1.weight``,
Qwen2-MoE ``mlp.experts.3.gate_proj.weight``), stacked in the model (``mlp.experts.gate_up_proj`` ``(E, 2I, H)``)
by transformers' conversion mapping. The streamed run writes the tensors (names and bytes) of the in-memory run,
``from_pretrained`` of both gives the same logits, the stacked experts hold the stored experts (gate rows, then
up rows); a missing expert tensor is named; a crashed run resumes; two ranks write the bytes of one process."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

import bridge
import qtransform as qt
import tiny_lm
from bridge.app.cli import main
from bridge.checkpoint import CheckpointError
from moe.tiny_moe import build_tiny_moe
from stream_ranks import calibration, run_ranks, same_outputs, written

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

ARCHS = ("mixtral", "qwen2_moe")
#: the stored names of expert e's three matrices in layer l: gate, up, down
EXPERT_KEYS = {"mixtral": "model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight",
               "qwen2_moe": "model.layers.{l}.mlp.experts.{e}.{w}_proj.weight"}
WS = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate", "up", "down")}
PRESETS = {"int4-g32": (), "gptq4-g64": ("--calib", "4", "--seq-len", "24")}
IDS = torch.tensor([[1, 5, 9, 2, 17, 3, 30, 4, 11, 7, 8, 12]])
E, LAYERS = 4, 2


def header_tensors(directory: Path) -> dict[str, tuple[Path, dict]]:
    """``{name: (file, header entry)}`` read from the safetensors headers themselves."""
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        out.update({k: (f, v) for k, v in header.items() if k != "__metadata__"})
    return out


def raw_tensors(directory: Path) -> dict[str, tuple[str, list, bytes]]:
    """``{name: (dtype, shape, data bytes)}`` of a checkpoint, from its files."""
    out = {}
    for name, (f, e) in header_tensors(directory).items():
        blob = f.read_bytes()
        start = 8 + struct.unpack("<Q", blob[:8])[0]
        b, end = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], blob[start + b:start + end])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-stream")
    out = {}
    for arch in ARCHS:
        src = root / arch
        build_tiny_moe(arch, experts=E, layers=LAYERS).to(torch.bfloat16).save_pretrained(src, max_shard_size="40KB")
        tiny_lm.tokenizer().save_pretrained(src)
        for preset, extra in PRESETS.items():
            for mode in ("stream", "memory"):
                o = root / f"{arch}-{preset}-{mode}"
                rc = main(["quantize", "--model", str(src), "--recipe", preset, "--out", str(o), "--threads", "1",
                           "--no-eval", *extra, *(["--stream"] if mode == "stream" else [])])
                assert rc == 0
                out[arch, preset, mode] = o
        out[arch] = src
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_stores_the_experts_one_by_one(runs, arch):
    names = set(header_tensors(runs[arch]))
    want = {EXPERT_KEYS[arch].format(l=i, e=e, w=w) for i in range(LAYERS) for e in range(E) for w in WS[arch]}
    assert want <= names
    assert not [n for n in names if n.endswith("gate_up_proj") or n.endswith("experts.down_proj")]
    assert len({header_tensors(runs[arch])[n][0] for n in want}) > 1  # the experts span several shards


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("arch", ARCHS)
def test_stream_writes_the_tensors_of_the_in_memory_run(runs, arch, preset):
    from transformers import AutoModelForCausalLM

    streamed, in_memory = raw_tensors(runs[arch, preset, "stream"]), raw_tensors(runs[arch, preset, "memory"])
    assert sorted(streamed) == sorted(in_memory)
    assert [n for n in streamed if streamed[n] != in_memory[n]] == []
    assert "model.layers.1.mlp.experts.gate_up_proj" in streamed  # the stacked experts, quantized (native parts)
    assert streamed["model.layers.1.mlp.experts.gate_up_proj"][0] in ("U8", "I8")
    logits = {}
    for mode in ("stream", "memory"):
        with torch.no_grad():
            logits[mode] = AutoModelForCausalLM.from_pretrained(runs[arch, preset, mode]).eval()(input_ids=IDS).logits
    assert torch.equal(logits["stream"], logits["memory"])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_stacked_experts_hold_the_stored_experts(runs, arch):
    """gate_up_proj[e] = cat(gate_e, up_e) and down_proj[e] = down_e, the stored tensors read with safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    stored = {}
    for f in runs[arch].glob("*.safetensors"):
        stored.update(load_file(str(f)))
    qtree = bridge.extract(AutoModelForCausalLM.from_pretrained(runs[arch, "int4-g32", "stream"]))
    gate, up, down = WS[arch]
    for i in range(LAYERS):
        key = lambda e, w: stored[EXPERT_KEYS[arch].format(l=i, e=e, w=w)].float()  # noqa: E731
        want = {"gate_up_proj": torch.stack([torch.cat([key(e, gate), key(e, up)]) for e in range(E)]),
                "down_proj": torch.stack([key(e, down) for e in range(E)])}
        for name, w in want.items():
            q = qtree[f"model.layers.{i}.mlp.experts.{name}"]
            assert isinstance(q, qt.QTensor) and tuple(q.shape) == tuple(w.shape)
            err = (qt.dequantize(q).float() - w).norm() / w.norm()
            assert err < 0.12, (name, float(err))  # int4, groups of 32: a few percent; a wrong order ~1.4


def _copy_without(src: Path, dst: Path, drop: str | None = None, add: dict | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    where = header_tensors(dst)
    f = where[drop][0] if drop else next(iter(where.values()))[0]
    tensors = load_file(str(f))
    tensors.pop(drop, None)
    tensors.update(add or {})
    save_file(tensors, str(f), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].pop(drop, None)
        data["weight_map"].update({k: f.name for k in add or {}})
        index.write_text(json.dumps(data))
    return dst


def test_a_missing_expert_tensor_is_named(runs, tmp_path):
    from bridge.stream import quantize_checkpoint

    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    src = _copy_without(runs["qwen2_moe"], tmp_path / "src", drop=gone)
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        quantize_checkpoint(src, tmp_path / "out", qt.get_preset("int4-g32").recipe)
    extra = _copy_without(runs["qwen2_moe"], tmp_path / "src2", add={"model.layers.0.mlp.experts.9.up_proj.weight":
                                                                     torch.zeros(32, 64, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"experts\.9\.up_proj\.weight'\], which are not tensors of the model"):
        quantize_checkpoint(extra, tmp_path / "out", qt.get_preset("int4-g32").recipe)
    assert not (tmp_path / "out").exists()


def test_a_crashed_run_resumes_to_the_same_bytes(runs, tmp_path, monkeypatch):
    from bridge.stream import blocks, quantize_checkpoint

    recipe, src = qt.get_preset("gptq4-g64").recipe, runs["mixtral"]
    quantize_checkpoint(src, tmp_path / "whole", recipe, calibration=calibration())
    real = blocks.BlockRun._block

    def crash(self, name):
        if name.endswith(".1"):
            raise RuntimeError("crash")
        return real(self, name)

    monkeypatch.setattr(blocks.BlockRun, "_block", crash)
    with pytest.raises(RuntimeError, match="crash"):
        quantize_checkpoint(src, tmp_path / "out", recipe, calibration=calibration())
    monkeypatch.setattr(blocks.BlockRun, "_block", real)
    done = quantize_checkpoint(src, tmp_path / "out", recipe, calibration=calibration(), resume=True)
    assert done.written.resumed == 1
    assert written(tmp_path / "out") == written(tmp_path / "whole")


def test_two_ranks_write_the_bytes_of_one_process(runs, tmp_path):
    cases = (("gptq4-g64", True, True, {}), ("hqq4-g64", False, False, {}))
    results = run_ranks(2, same_outputs, runs["qwen2_moe"], tmp_path, cases)
    for preset, _, _, _ in cases:
        one, two = written(tmp_path / f"{preset}-one"), written(tmp_path / preset)
        assert one and sorted(two) == sorted(one) and [f for f in one if one[f] != two[f]] == []
        assert results[0][preset] == results[1][preset]
