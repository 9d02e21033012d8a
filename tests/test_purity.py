"""House rules that code can check: qtransform stays pure and importable on its own."""

import ast
import pathlib
import subprocess
import sys

import qtransform

ROOT = pathlib.Path(qtransform.__file__).parent
FORBIDDEN = ("bridge", "safetensors", "transformers", "torch.nn")


def test_qtransform_sources_import_no_bridge_files_or_modules():
    offenders = []
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                if getattr(node.value.value, "id", None) == "torch" and node.value.attr == "nn":
                    names = ["torch.nn"]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(FORBIDDEN)]
    assert offenders == []


def test_importing_qtransform_loads_no_bridge_safetensors_or_transformers():
    code = ("import sys, qtransform, qtransform.testing; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('bridge', 'safetensors', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_assert_no_grad_decorators_in_library_code():
    bad = []
    for path in ROOT.rglob("*.py"):
        if path.name == "testing.py":
            continue
        text = path.read_text()
        bad += [f"{path.name}: assert" for line in text.splitlines() if line.strip().startswith("assert ")]
        bad += [f"{path.name}: no_grad" for line in text.splitlines()
                if line.strip().startswith(("@torch.no_grad", "@torch.inference_mode"))]
    assert bad == []
