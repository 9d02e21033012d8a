"""What checksums cost: save and load of the default model (SmolLM2-135M) quantized int4 g64,
loading with and without verification, through bridge.load and from_pretrained, side by side.

    .venv/bin/python bench/bench_checkpoint.py
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

import qtransform as qt
import bridge
from bridge.app import models
from bridge.checkpoint import checksum

from common import markdown, timeit, write


def main() -> None:
    from transformers import AutoModelForCausalLM
    model = models.load_causal_lm().eval()
    recipe = qt.Recipe(default=qt.QuantSpec(format="int4", granularity=qt.PerGroup(64), symmetric=False),
                       exclude=["lm_head*"])
    qmodel = bridge.quantize(model, recipe)
    root = Path(tempfile.mkdtemp())
    d = root / "ck"
    try:
        def save():
            bridge.save(qmodel, d, overwrite=True)

        save()
        size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
        files = sorted(d.glob("*.safetensors"))
        t = timeit({
            "save": save,
            "verify only": lambda: checksum.verify_files(files),
            "bridge.load": lambda: bridge.load(d, like=model),
            "bridge.load verify=False": lambda: bridge.load(d, like=model, verify=False),
            "from_pretrained": lambda: AutoModelForCausalLM.from_pretrained(d),
            "from_pretrained verify=False": lambda: AutoModelForCausalLM.from_pretrained(
                d, quantization_config=bridge.QTransformConfig(verify=False)),
        }, repeat=5)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [{"case": k, "seconds": round(v, 3)} for k, v in t.items()]
    ratios = {"bridge.load": t["bridge.load"] / t["bridge.load verify=False"],
              "from_pretrained": t["from_pretrained"] / t["from_pretrained verify=False"]}
    table = markdown(["case", "seconds"], [[r["case"], r["seconds"]] for r in rows])
    table += (f"\n\ncheckpoint {size / 1e6:.1f} MB; hashing {size / 1e9 / t['verify only']:.2f} GB/s; "
              f"verified/unverified load: bridge.load x{ratios['bridge.load']:.2f}, "
              f"from_pretrained x{ratios['from_pretrained']:.2f}; load average {os.getloadavg()[0]:.1f}")
    write("checkpoint", rows, table, {"bytes": size, "ratios": ratios, "load_average": os.getloadavg()[0]})


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
