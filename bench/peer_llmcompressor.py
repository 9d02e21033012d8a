"""llm-compressor's GPTQ (or AWQ: ``--method awq``) on a float model directory, for bench/bench_gptq.py and
bench/bench_awq.py (run with the python of a virtualenv holding ``llmcompressor``: ``make bench-gptq-peer``). Times the ``oneshot`` call alone, then
the perplexity of the model it leaves (weights quantized in place), scored as ``bridge.app.evaluate``
scores ours: each sequence on its own, next-token NLL summed over all positions, exp(mean).

    /tmp/llmc/bin/python bench/peer_llmcompressor.py --model DIR --tokens calib.pt --eval eval.pt \\
        --scheme uint4-asym-g64 --threads 2 --out result.json [--method awq]

AWQ is llm-compressor's ``AWQModifier`` (its defaults: 20-point grid, duo scaling, no clipping search)
followed by a ``QuantizationModifier`` with the same weight scheme (min/max ranges). On a machine without
an accelerator ``Tensor.pin_memory`` is made a no-op (its AWQ pipeline pins cached activations).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

SCHEMES = {"uint4-asym-g64": (4, False, 64), "int4-sym-g64": (4, True, 64), "uint3-asym-g64": (3, False, 64),
           "int3-sym-g64": (3, True, 64), "uint4-asym-g128": (4, False, 128)}


def perplexity(model, ids: torch.Tensor) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in ids.split(4):
            logits = model(input_ids=batch).logits[:, :-1].float()
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += batch[:, 1:].numel()
    return math.exp(total / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--scheme", required=True, choices=list(SCHEMES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", choices=["gptq", "awq"], default="gptq")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not torch.cuda.is_available():  # its AWQ pipeline pins cached activations, which needs an accelerator
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    bits, symmetric, group = SCHEMES[a.scheme]
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    model.eval()
    calib, ev = torch.load(a.tokens), torch.load(a.eval)
    data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group}
    if a.method == "awq":
        recipe = [_awq_modifier(), QuantizationModifier(config_groups={"g": {"targets": ["Linear"], "weights": weights}},
                                                        ignore=["lm_head"])]
    else:
        recipe = GPTQModifier(config_groups={"g": {"targets": ["Linear"], "weights": {**weights, "actorder": "static"}}},
                              ignore=["lm_head"], block_size=128, dampening_frac=0.01)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    t = time.perf_counter()
    processor = transformers.AutoTokenizer.from_pretrained(a.model)
    oneshot(model=model, processor=processor, dataset=data, recipe=recipe, num_calibration_samples=calib.shape[0],
            max_seq_length=calib.shape[1])
    seconds = time.perf_counter() - t
    after = model.model.layers[0].self_attn.q_proj.weight.detach()
    changed = not torch.equal(before, after)
    ppl = perplexity(model, ev)
    versions = {"llmcompressor": llmcompressor.__version__, "transformers": transformers.__version__,
                "torch": torch.__version__}
    with open(a.out, "w") as f:
        json.dump({"scheme": a.scheme, "method": a.method, "seconds": seconds, "ppl": ppl, "weights_changed": changed,
                   "versions": versions}, f)
    print(json.dumps({"scheme": a.scheme, "seconds": round(seconds, 1), "ppl": round(ppl, 3), "changed": changed}))


def _awq_modifier():
    try:  # where newer releases keep it
        from llmcompressor.modifiers.transform.awq import AWQModifier
    except ImportError:
        from llmcompressor.modifiers.awq import AWQModifier
    return AWQModifier()


if __name__ == "__main__":
    main()
