"""hqq's own end to end, as a user runs it, for bench/bench_cli.py: load a transformers directory, quantize
every linear with HQQ (4 bits, group 64: qtransform's `hqq4-g64`), save the quantized model.

Run: ``python bench/peer_hqq_e2e.py MODEL_DIR OUT_DIR``; prints one JSON line of phase seconds
(``import``, ``load``, ``quantize``, ``save``)."""

from __future__ import annotations

import json
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
from hqq.core.quantize import BaseQuantizeConfig  # noqa: E402
from hqq.models.hf.base import AutoHQQHFModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main(model_dir: str, out_dir: str) -> None:
    phases = {"import": time.perf_counter() - t0}
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    phases["load"] = time.perf_counter() - t
    t = time.perf_counter()
    AutoHQQHFModel.quantize_model(model, quant_config=BaseQuantizeConfig(nbits=4, group_size=64),
                                  compute_dtype=torch.float32, device="cpu")
    phases["quantize"] = time.perf_counter() - t
    t = time.perf_counter()
    AutoHQQHFModel.save_quantized(model, out_dir)
    phases["save"] = time.perf_counter() - t
    print(json.dumps(phases))


if __name__ == "__main__":
    main(*sys.argv[1:3])
