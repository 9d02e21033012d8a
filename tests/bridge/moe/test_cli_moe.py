"""``qtransform quantize`` on tiny mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE, DeepSeek-V3 with a dense first layer, GPT-OSS with transposed, biased experts) with every preset, as
``test_cli_archs.py`` runs the dense families: quantize, save, reload with ``from_pretrained``, same logits as the
quantized model the command held in memory; every expert weight quantized with the preset's spec (per expert),
the routers left in float, and the calibrated steps' report listing every expert's tokens.

``make test`` runs every preset once, on the architectures in turn; ``make test-long`` the whole matrix.
"""

import json

import pytest
import torch

import bridge
import qtransform as qt
import tiny_lm
from bridge.app.cli import main
from bridge_util import on_command_model, same_model_bound

from .tiny_moe import build_tiny_moe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
PRESETS = tuple(qt.presets())
IDS = torch.tensor([[1, 5, 9, 2, 17, 3, 30, 4, 11, 7, 8, 12]])


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    dirs = {}
    for arch in ARCHS:
        model = build_tiny_moe(arch)
        model.save_pretrained(root / arch)
        tiny_lm.tokenizer().save_pretrained(root / arch)
        dirs[arch] = root / arch
    return dirs


def _covering() -> set[tuple[str, str]]:
    """Every preset once, the architectures in turn (each gets every seventh or so): ``make test``'s set."""
    return {(ARCHS[i % len(ARCHS)], preset) for i, preset in enumerate(PRESETS)}


COVERING = _covering()
MATRIX = [pytest.param(arch, preset, id=f"{arch}-{preset}", marks=() if (arch, preset) in COVERING else pytest.mark.long)
          for arch in ARCHS for preset in PRESETS]


def _needs_data(preset) -> bool:
    p = qt.get_preset(preset)
    act = p.recipe.input
    return any(qt.ALGORITHMS[s.name].needs is not None for s in p.steps) or (act is not None and not act.dynamic)


def _experts(model) -> dict[str, tuple[int, ...]]:
    """The stacked expert weights of the float model, found by walking its modules (3-D parameters of modules
    whose class name ends in Experts)."""
    return {f"{n}.{k}": tuple(p.shape) for n, m in model.named_modules() if type(m).__name__.endswith("Experts")
            for k, p in m.named_parameters(recurse=False) if p.dim() == 3}


def _refused(arch: str, preset: str) -> bool:
    """Refused by name, nothing written: a 4-bit-activation rotation needs an online Hadamard before every
    expert's down projection (inside the experts' forward), and SpinQuant learns a rotation between value and
    output heads, which DeepSeek-V3's latent attention does not have."""
    steps = {s.name for s in qt.get_preset(preset).steps}
    act = qt.get_preset(preset).recipe.input
    w4a4 = bool(steps & {"rotate", "spinquant"}) and act is not None and qt.get_format(act.format).codec.bits < 8
    return w4a4 or ("spinquant" in steps and arch == "deepseek_v3")


def test_the_covering_set_covers():
    assert {p for _, p in COVERING} == set(PRESETS) and {a for a, _ in COVERING} == set(ARCHS)


@pytest.mark.parametrize("arch,preset", MATRIX)
def test_every_preset_on_every_moe_architecture_round_trips(arch, preset, model_dirs, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ckpt"
    seen = {}
    on_command_model(monkeypatch, lambda qmodel: seen.update(logits=qmodel(input_ids=IDS).logits))
    calib = ["--calib", "4", "--seq-len", "24"] if _needs_data(preset) else []
    cmd = ["quantize", "--in-memory", "--model", str(model_dirs[arch]), "--recipe", preset, "--out", str(out), "--threads", "1",
           "--no-eval", *calib]
    if _refused(arch, preset):
        rc = main(cmd)
        assert rc == 1 and not out.exists()
        return
    rc = main(cmd)
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    original = AutoModelForCausalLM.from_pretrained(model_dirs[arch]).eval()
    experts = _experts(original)
    assert experts
    rows = {r["path"]: r for r in rep["layers"]}
    assert set(experts) <= set(rows), "an expert weight is missing from the report"

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        again = loaded(input_ids=IDS).logits
        before = original(input_ids=IDS).logits
    assert torch.equal(again, seen["logits"])
    assert not torch.equal(again, before)
    assert (again - before).abs().max() < same_model_bound(original, preset, IDS, before)
    qtree = bridge.extract(loaded)
    spec = qt.get_preset(preset).spec
    for path, shape in experts.items():
        q = qtree[path]
        assert isinstance(q, qt.QTensor) and tuple(q.shape) == shape, path
        assert qt.matrix_spec(q.spec, shape).format == spec.format
    routers = [p for p, t in bridge.tree.module_types(original).items() if t == "Router"]
    assert all(not isinstance(qtree[p], qt.QTensor) for p in routers)
    if any(s.name == "gptq" for s in qt.get_preset(preset).steps):
        info = rep["step_info"]
        for path in experts:
            tokens = info[path]["experts"]["tokens"]
            assert len(tokens) == experts[path][0] and sum(tokens) > 0
