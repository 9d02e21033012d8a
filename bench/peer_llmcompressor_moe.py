"""llm-compressor's GPTQ on a float mixture-of-experts model directory, for bench/bench_moe.py (run with the
python of a virtualenv holding ``llmcompressor``: ``make bench-gptq-peer``). int4, symmetric, group 32 on every
``Linear`` but ``lm_head`` and the routers (``mlp.gate``), GPTQModifier's defaults otherwise (block 128,
dampening 0.01, ``actorder="static"``, its min/max observer); ``--all-experts`` is oneshot's
``moe_calibrate_all_experts=True`` (every expert sees every token; its default), without it False (routed tokens).

llm-compressor linearizes the fused 3-D experts (``llmcompressor.modeling.moe``: one ``gate_proj``, ``up_proj``,
``down_proj`` Linear per expert, copied from ``gate_up_proj[e, :I]``, ``gate_up_proj[e, I:]``, ``down_proj[e]``).
Its GPTQ leaves each Linear's weight fake-quantized in place (``weight_scale * q``) beside ``weight_scale``. Writes
``--out`` (torch.save): ``seconds`` (the ``oneshot`` call), ``versions``, ``weights`` and ``float`` (the
fake-quantized and the loaded float weights, stacked back to ``{experts path.gate_up_proj: (E, 2I, H),
experts path.down_proj: (E, H, I)}``), and ``grid_error`` (the largest ``|w / scale - round(w / scale)|`` and
``|round(w / scale)|`` over all expert weights: 0 and <= 8 when the weights are exactly on its int4 grid).

    /tmp/qtransform-llmc/bin/python bench/peer_llmcompressor_moe.py --model DIR --tokens calib.pt \\
        --threads 2 --out result.pt [--all-experts]
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch


def expert_linears(model) -> dict:
    """``{experts path: [(gate, up, down) Linear of expert e]}`` of the linearized model."""
    out = {}
    for name, m in model.named_modules():
        if re.fullmatch(r".*\.experts\.\d+", name) and hasattr(m, "down_proj"):
            path, e = name.rsplit(".", 1)
            out.setdefault(path, {})[int(e)] = (m.gate_proj, m.up_proj, m.down_proj)
    return {p: [d[e] for e in range(len(d))] for p, d in out.items()}


def stacked(linears: dict, attr: str = "weight") -> dict:
    out = {}
    for path, per in linears.items():
        out[f"{path}.gate_up_proj"] = torch.stack([torch.cat([getattr(g, attr), getattr(u, attr)]) for g, u, _ in per])
        out[f"{path}.down_proj"] = torch.stack([getattr(d, attr) for _, _, d in per])
    return {k: v.detach().float().clone() for k, v in out.items()}


def grid_error(linears: dict, group: int) -> tuple[float, float]:
    frac, top = 0.0, 0.0
    for per in linears.values():
        for lin in (x for trio in per for x in trio):
            w, s = lin.weight.detach().float(), lin.weight_scale.detach().float()
            q = w / s.repeat_interleave(group, dim=1)[:, : w.shape[1]]
            frac = max(frac, float((q - q.round()).abs().max()))
            top = max(top, float(q.round().abs().max()))
    return frac, top


def _tokenizer(vocab: int):
    """A word-level tokenizer of ``vocab`` ids (the random model has none; oneshot wants a processor, the dataset
    is already token ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", unk_token="0")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--all-experts", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import compressed_tensors
    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import GPTQModifier

    # linearized after loading: its load_quantizable_moe patches transformers' modules, which imports every
    # transformers model (aria's image processor needs torchvision, absent here) for Qwen3-MoE
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    linearize_moe(model)
    model.eval()
    linears = expert_linears(model)
    if not linears:
        raise SystemExit(f"no linearized experts in {type(model).__name__}: {[n for n, _ in model.named_modules()][:40]}")
    float_weights = stacked(linears)
    calib = torch.load(a.tokens)
    data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": a.group}
    recipe = GPTQModifier(config_groups={"g": {"targets": ["Linear"], "weights": weights}},
                          ignore=["lm_head", "re:.*mlp.gate$"])
    t = time.perf_counter()
    oneshot(model=model, processor=_tokenizer(model.config.vocab_size), dataset=data, recipe=recipe, num_calibration_samples=calib.shape[0],
            max_seq_length=calib.shape[1], moe_calibrate_all_experts=a.all_experts)
    seconds = time.perf_counter() - t
    linears = expert_linears(model)
    frac, top = grid_error(linears, a.group)
    versions = {"llmcompressor": str(llmcompressor.__version__), "compressed_tensors": str(compressed_tensors.__version__),
                "transformers": transformers.__version__, "torch": str(torch.__version__)}
    torch.save({"seconds": seconds, "versions": versions, "weights": stacked(linears), "float": float_weights,
                "grid_error": frac, "grid_max": top, "all_experts": a.all_experts}, a.out)
    print(json.dumps({"seconds": round(seconds, 2), "grid_error": frac, "grid_max": top, "versions": versions}))


if __name__ == "__main__":
    main()
