"""torchao's quantization-aware training on a float model directory, for bench/bench_qat.py. Run with the python of
a virtualenv holding ``torchao`` (``make bench-qat-peer``; the project's own .venv has torchao 0.18 too).

What runs (torchao 0.18's QAT API, ``torchao.quantization.qat``):

1. ``quantize_(model, QATConfig(weight_config=IntxFakeQuantizeConfig(torch.int<bits>, group_size=G,
   is_symmetric=False[, zero_point_domain=FLOAT, zero_point_precision=float32]), step="prepare"), filter_fn)``: every
   ``nn.Linear`` but ``lm_head`` (tied to the embedding, kept float on both sides) becomes a ``FakeQuantizedLinear``
   whose weight is fake-quantized per group of G along in_features on every forward (weight-only: no activation
   config). ``--zero-point int`` is that config's default (``ZeroPointDomain.INT``); ``float`` is the tinygemm
   scheme (a float zero point), torchao's asymmetric per-group form whose numerics are round to nearest.
2. Training end to end: Adam (no weight decay) on the fake-quantized linears' weights alone (embedding, norms and the
   head frozen, as ours trains only the tensors it quantizes), next-token cross-entropy of the whole model, ``--iters``
   steps of ``--batch-size`` calibration sequences drawn from a seeded shuffle of all of them (epoch after epoch),
   learning rate ``--lr`` under the cosine decay to 0 that ours uses.
3. Convert: each weight replaced by its fake quantizer's output (exactly what a forward of the trained model uses), then
   ``quantize_(model, QATConfig(step="convert"))`` swaps the modules back to ``nn.Linear``. (torchao's own convert
   applies a PTQ ``base_config``; the only one for asymmetric int2/int3/int4 per group, ``IntxWeightOnlyConfig``,
   is refused by ``QATConfig`` for asymmetric mappings: the probe's message is in the result.)

The seconds cover 1-3. The float model's perplexities come first (bench_qat.py checks them against its own). The
result then checks that every trained layer holds at most ``2**bits`` distinct values
per group, scores perplexity on each ``--eval`` file as ``bridge.app.evaluate`` scores ours, and records the peak
resident memory of this process. Where torchao cannot run the width (a group size that does not divide a layer's
in_features: it asserts, ours pads the last group), the result is ``{"refused": why}``, nothing faked.

    /tmp/qtransform-torchao/bin/python bench/peer_torchao_qat.py --model DIR --tokens calib.pt \\
        --eval other.pt builtin.pt --bits 2 --group-size 64 --iters 100 --batch-size 4 --lr 2e-5 --threads 2 \\
        --out result.json [--zero-point float]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time

import torch

from peer_autoround import distinct_per_group
from peer_llmcompressor import perplexity


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--eval", nargs="+", required=True, help="token files to score (n, seq_len) each")
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--iters", type=int, required=True, help="Adam steps of the whole model")
    ap.add_argument("--batch-size", type=int, required=True, help="calibration sequences per step")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--zero-point", choices=("int", "float"), default="int")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    return ap


def quantized_linear(module, fqn: str) -> bool:
    return isinstance(module, torch.nn.Linear) and not fqn.endswith("lm_head")


def weight_config(bits: int, group: int, zero_point: str):
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.quant_primitives import ZeroPointDomain

    extra = {} if zero_point == "int" else {"zero_point_domain": ZeroPointDomain.FLOAT,
                                            "zero_point_precision": torch.float32}
    return IntxFakeQuantizeConfig(getattr(torch, f"int{bits}"), group_size=group, is_symmetric=False, **extra)


def base_config_route(bits: int, group: int) -> str | None:
    """What torchao says to ``QATConfig(IntxWeightOnlyConfig(int<bits>, PerGroup(group), ASYMMETRIC))`` (the route
    whose convert step quantizes for real) on one linear layer: None where it accepts it, else its message."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import QATConfig
    from torchao.quantization.quant_primitives import MappingType

    try:
        cfg = IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{bits}"), granularity=PerGroup(group),
                                   mapping_type=MappingType.ASYMMETRIC)
        quantize_(torch.nn.Sequential(torch.nn.Linear(2 * group, 4)), QATConfig(cfg, step="prepare"))
    except Exception as e:  # noqa: BLE001 - torchao asserts; its word is the result
        return f"{type(e).__name__}: {e}"
    return None


def batches(n: int, batch_size: int, iters: int, seed: int):
    """``iters`` index tensors of ``batch_size`` sequences of ``n``: a seeded shuffle, epoch after epoch."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    for _ in range(iters):
        while len(order) < batch_size:
            order += torch.randperm(n, generator=gen).tolist()
        yield torch.tensor(order[:batch_size])
        order = order[batch_size:]


def train(model, calib: torch.Tensor, a) -> tuple[list[float], str | None]:
    """Prepare, train and convert ``model`` in place; ``(losses, None)``, or ``([], why)`` where torchao refuses."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    try:  # torchao raises (or asserts) on what it cannot do: at prepare, or at a weight's first fake quantization
        quantize_(model, QATConfig(weight_config=weight_config(a.bits, a.group_size, a.zero_point), step="prepare"),
                  filter_fn=quantized_linear)
    except Exception as e:  # noqa: BLE001
        return [], f"QATConfig prepare: {type(e).__name__}: {e or 'assertion failed'}"
    fake = {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)}
    for name, m in fake.items():
        try:
            with torch.no_grad():
                m.weight_fake_quantizer(m.weight)
        except Exception as e:  # noqa: BLE001
            return [], f"{name} {tuple(m.weight.shape)}: {type(e).__name__}: {e or 'assertion failed'}"
    for p in model.parameters():
        p.requires_grad_(False)
    weights = [m.weight for m in fake.values()]
    for w in weights:
        w.requires_grad_(True)
    opt = torch.optim.Adam(weights, lr=a.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(  # ours: qtransform.learn.optim.cosine(t, iters)
        opt, lambda t: 1.0 if a.iters <= 1 else 0.5 * (1.0 + math.cos(math.pi * t / a.iters)))
    model.train()
    losses = []
    for idx in batches(calib.shape[0], a.batch_size, a.iters, a.seed):
        ids = calib[idx]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(round(float(loss.detach()), 4))
    model.eval()
    with torch.no_grad():
        for m in fake.values():
            m.weight.requires_grad_(False)
            m.weight.copy_(m.weight_fake_quantizer(m.weight))
    quantize_(model, QATConfig(step="convert"), filter_fn=lambda m, fqn: isinstance(m, FakeQuantizedLinear))
    return losses, None


def main() -> None:
    a = parser().parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    import torchao
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.eval()
    calib, evs = torch.load(a.tokens), [torch.load(p) for p in a.eval]
    versions = {"torchao": torchao.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    result = {"bits": a.bits, "group_size": a.group_size, "iters": a.iters, "batch_size": a.batch_size, "lr": a.lr,
              "zero_point": a.zero_point, "seed": a.seed, "tokens": a.iters * a.batch_size * calib.shape[1],
              "base_config_route": base_config_route(a.bits, a.group_size), "versions": versions}
    result["fp_ppl"] = [perplexity(model, ev) for ev in evs]  # the float model as loaded here (the main script checks)
    load_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    losses, refused = train(model, calib, a)
    seconds = time.perf_counter() - t
    if refused is not None:
        result["refused"] = refused
    else:
        worst, layers = distinct_per_group(model, a.group_size)
        if worst > 2 ** a.bits:
            raise SystemExit(f"torchao left up to {worst} distinct values in a group of {a.group_size} "
                             f"(at most {2 ** a.bits} expected): weights are not quantized")
        result.update(seconds=seconds, ppl=[perplexity(model, ev) for ev in evs], losses=losses,
                      max_distinct_per_group=worst, linear_layers=layers)
    result.update(rss_load_kib=load_kib, peak_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    with open(a.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: result.get(k) for k in ("bits", "group_size", "zero_point", "seconds", "ppl", "refused")}))


if __name__ == "__main__":
    main()
