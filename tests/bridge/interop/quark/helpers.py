"""Shared helpers of the Quark export/import tests: tiny models quantized and saved, exports loaded by
transformers with amd-quark in a clean interpreter, trees compared bit for bit."""

import json
import os
import subprocess
import sys

import torch
from bridge_util import same_bits, tiny_causal_lm

import bridge
import qtransform as qt
from bridge import interop
from bridge.interop.quark import QuarkImporter
from qtransform.pipeline import linear_recipe

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
CALIB = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")

# transformers with amd-quark, alone: every case's logits, or the error it met
_LOAD = r"""
import json, sys, torch, transformers
cases, out = json.load(open(sys.argv[1])), {}
for name, c in cases.items():
    try:
        model = getattr(transformers, c["auto"]).from_pretrained(c["dir"]).eval()
        with torch.no_grad():
            logits = model(torch.load(c["ids"])).logits
        kinds = [type(m).__name__ for m in model.modules()]
        out[name] = {"logits": logits, "quark_layers": kinds.count("QParamsLinear")}
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}
assert not [m for m in sys.modules if m.split(".")[0] in ("bridge", "qtransform")], "bridge was imported"
torch.save(out, sys.argv[2])
"""


def quark_logits(cases: dict, tmp_path, *, then=None) -> dict:
    """``{name: {"logits", "quark_layers"} | {"error"}}`` for ``{name: (export dir, auto class, ids)}``.

    ``then``: ``(code, args)``, more Python that the same clean process runs afterwards (amd-quark imported
    once), its arguments from ``sys.argv[3]`` on."""
    spec = {}
    for name, (d, auto, ids) in cases.items():
        torch.save(ids, tmp_path / f"{name}.ids.pt")
        spec[name] = {"dir": str(d), "auto": auto, "ids": str(tmp_path / f"{name}.ids.pt")}
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    code, args = then if then is not None else ("", [])
    res = subprocess.run([sys.executable, "-c", _LOAD + code, str(tmp_path / "cases.json"), str(tmp_path / "out.pt"),
                          *args], capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


def recipe_of(recipe):
    """A preset name, a spec for the linear layers (lm_head excluded) or a Recipe, as a Recipe."""
    if isinstance(recipe, str):
        return qt.get_preset(recipe).recipe
    return linear_recipe(recipe) if isinstance(recipe, qt.QuantSpec) else recipe


def quantize_save(arch: str, recipe, path, *, calib=False, seed=0):
    """A tiny ``arch`` model quantized with ``recipe`` (preset name or spec), saved to ``path``."""
    torch.manual_seed(seed)
    model = tiny_causal_lm(arch).eval()
    qmodel = bridge.quantize(model, recipe_of(recipe), calibration=CALIB if calib else None)
    bridge.save(qmodel, path)
    return model, qmodel


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def spec(fmt, gran, **kw):
    return qt.QuantSpec(format=fmt, granularity=gran, **kw)


def assert_same_tree(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for path, x in a.items():
        y = b[path]
        assert type(x) is type(y), path
        if isinstance(x, qt.QTensor):
            assert (x.spec, x.width, x.dtype) == (y.spec, y.width, y.dtype), path
            assert same_bits(x.codes, y.codes), path
            tx, ty = x.qparams.tensors(), y.qparams.tensors()
            assert sorted(tx) == sorted(ty), path
            assert all(same_bits(tx[k], ty[k]) for k in tx), path
        else:
            assert same_bits(x, y), path


def round_trip(ckpt, out):
    """Export ``ckpt`` to ``out`` and read it back: the same tree, specs, activation quantizers and config."""
    interop.export(ckpt, to="quark", out=out)
    source = interop.read_source(ckpt)
    assert QuarkImporter().detect(out) and interop.detect_format(out) == "quark"
    back = QuarkImporter().read(out)
    assert_same_tree(source.tree, back.tree)
    assert back.meta.entries == source.meta.entries
    assert dict(back.meta.activations) == dict(source.meta.activations)
    assert back.config["architectures"]  # written where the checkpoint had none (vLLM picks the class by it)
    assert {k: v for k, v in back.config.items() if k != "architectures"} == \
        {k: v for k, v in source.config.items() if k != "architectures"}
    return source, back


def stored(directory) -> dict:
    from safetensors.torch import load_file
    return load_file(str(directory / "model.safetensors"))
