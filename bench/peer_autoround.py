"""Intel's AutoRound (SignRound) on a float model directory, for bench/bench_signround.py. Run with the python of a
virtualenv holding ``auto-round`` (``make bench-signround-peer``). Calibrates on the exact token ids the main
script wrote (one ``(1, seq_len)`` tensor per sample: auto-round takes a list of token tensors as its
``dataset``), times the construction and the ``quantize()`` call, checks that every linear layer's weights
now hold at most ``2**bits`` distinct values per group (auto-round leaves them fake-quantized in place), then
scores perplexity as ``bridge.app.evaluate`` scores ours (bench/peer_llmcompressor.py's ``perplexity``).

    /tmp/autoround/bin/python bench/peer_autoround.py --model DIR --tokens calib.pt --eval eval.pt \\
        --bits 4 --group-size 128 --iters 4 --batch-size 1 --threads 2 --out result.json [--lr 0.25] [--sym] [--amp]

Unsigned asymmetric with an integer zero point unless ``--sym``. Float32 throughout unless ``--amp`` (auto-round
casts to bfloat16 on CPU by default; our side runs in float32).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from peer_llmcompressor import perplexity


def distinct_per_group(model, group: int) -> tuple[int, int]:
    """(largest number of distinct values in one group of ``group`` weights along in_features, the last group of a
    row the columns left over, number of linear layers checked) over every ``nn.Linear`` but the output head."""
    worst, layers = 0, 0
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        w = m.weight.detach().float()
        for start in range(0, w.shape[1], group):  # the last group may be shorter (576 columns in groups of 128)
            s = w[:, start:start + group].sort(dim=-1).values
            worst = max(worst, int((1 + (s.diff(dim=-1) != 0).sum(-1)).max()))
        layers += 1
    return worst, layers


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--sym", action="store_true", help="symmetric (default: asymmetric, integer zero point)")
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--lr", type=float, default=None, help="default: auto-round's own (1 / iters)")
    ap.add_argument("--amp", action="store_true", help="let auto-round cast to bfloat16 (its CPU default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    a = parser().parse_args()
    torch.set_num_threads(a.threads)
    import auto_round
    import transformers
    from auto_round import AutoRound

    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    calib, ev = torch.load(a.tokens), torch.load(a.eval)
    before = {n: m.weight.detach().clone() for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    extra = {} if a.lr is None else {"lr": a.lr}
    t = time.perf_counter()
    rounder = AutoRound(model, tok, bits=a.bits, group_size=a.group_size, sym=a.sym, iters=a.iters,
                        nsamples=calib.shape[0], seqlen=calib.shape[1], batch_size=a.batch_size,
                        dataset=list(calib.split(1)), device_map="cpu", amp=a.amp, **extra)
    rounder.quantize()
    seconds = time.perf_counter() - t
    quantized = rounder.model
    quantized.float()
    worst, layers = distinct_per_group(quantized, a.group_size)
    mods = dict(quantized.named_modules())
    changed = sum(not torch.equal(w.float(), mods[n].weight.detach().float()) for n, w in before.items())
    if layers != len(before) or worst > 2 ** a.bits:
        raise SystemExit(f"auto-round left {layers}/{len(before)} linear layers, up to {worst} distinct values in a "
                         f"group of {a.group_size} (at most {2 ** a.bits} expected): weights are not quantized")
    ppl = perplexity(quantized, ev)
    versions = {"auto_round": auto_round.__version__, "transformers": transformers.__version__,
                "torch": torch.__version__}
    result = {"bits": a.bits, "group_size": a.group_size, "sym": a.sym, "iters": a.iters, "batch_size": a.batch_size,
              "lr": a.lr, "amp": a.amp, "seconds": seconds, "ppl": ppl, "max_distinct_per_group": worst,
              "linear_layers": layers, "layers_changed": changed, "nsamples": calib.shape[0],
              "seqlen": calib.shape[1], "versions": versions}
    with open(a.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: result[k] for k in ("bits", "group_size", "seconds", "ppl", "max_distinct_per_group",
                                             "layers_changed")}))


if __name__ == "__main__":
    main()
