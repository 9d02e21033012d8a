"""A quantized checkpoint loads with transformers' ``from_pretrained`` and generates: the check that the
8B-shaped output of ``bench/bench_stream.py`` (case ``rtn-8b-stream``) is a working model.

    .venv/bin/python bench/check_generate.py /work/scratch/out/rtn-8b-stream

Prints the model's dtype, the class of its first down projection, the token generated, the seconds to
load and to generate, and the peak resident memory of the process.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import bridge  # noqa: F401  (registers the qtransform quantizer with transformers)


def main(directory: str, prompt: str = "The capital of France is") -> dict:
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    load_s = time.perf_counter() - t
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=1, do_sample=False)
    layer = next(m for n, m in model.named_modules() if n.endswith("down_proj"))
    row = {"checkpoint": directory, "dtype": str(model.dtype), "down_proj": type(layer).__name__,
           "token": tokenizer.decode(out[0, -1:]), "new_tokens": int(out.shape[1] - ids.shape[1]),
           "load_s": round(load_s, 1), "generate_s": round(time.perf_counter() - t, 2),
           "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main(*sys.argv[1:])
