"""GPTQ on the default model (SmolLM2-135M-Instruct), side by side with llm-compressor: perplexity ratio
quantized / float on 16x512 tokens of the built-in corpus's evaluation part, calibrated on 40x512 tokens
of its calibration part (other docstrings), and the seconds of the quantization call (calibration
forward passes included), both run in this script on the same tokens and threads, one after the other.

llm-compressor runs in its own virtualenv (its pins differ from ours): ``--peer-python /tmp/llmc/bin/python``
(``make bench-gptq-peer`` creates it); without it only our side runs and the issue's anchors are printed.

    .venv/bin/python bench/bench_gptq.py [--peer-python PY] [--only uint4-asym-g64 ...] [--hqq] [--gptaq]

``--hqq`` adds the HQQ-initialised GPTQ comparison at 3 and 2 bits (uint, float zero point, group 64).
``--gptaq`` adds GPTAQ (``Step("gptq", gptaq=True)``) beside GPTQ at uint4 and uint3 asym g64 (of the schemes
run): perplexity ratio and seconds of each, GPTQ's from the main rows.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import tempfile
import time

import torch

import qtransform as qt
import bridge
from bridge.app import corpus, evaluate, models

from common import markdown, merged, write

HERE = pathlib.Path(__file__).parent
#: name -> (format, symmetric); every scheme is group 64 along in_features unless named g128.
SCHEMES = {"uint4-asym-g64": ("uint4", False), "int4-sym-g64": ("int4", True), "uint3-asym-g64": ("uint3", False),
           "int3-sym-g64": ("int3", True), "uint4-asym-g128": ("uint4", False)}
#: The issue's anchors (SmolLM2-135M-Instruct, stdlib docstrings, fp ppl 13.456): Quark 0.13, llm-compressor 0.14.
ANCHORS = {"uint4-asym-g64": ("x1.109, 405 s", "x1.108, 162 s", "<= x1.08"), "int4-sym-g64": ("x1.201", "", "<= x1.15"),
           "uint3-asym-g64": ("x1.560, 419 s", "", "<= x1.45"), "int3-sym-g64": ("x3.10", "", "<= x2.0")}
#: The schemes ``--gptaq`` compares.
GPTAQ_SCHEMES = ("uint4-asym-g64", "uint3-asym-g64")


def spec_of(name: str, *, zero_point_domain: str | None = None) -> qt.QuantSpec:
    fmt, sym = SCHEMES[name]
    group = 128 if name.endswith("g128") else 64
    return qt.QuantSpec(format=fmt, granularity=qt.PerGroup(group), symmetric=sym, pad=True,
                        zero_point_domain=zero_point_domain)


def ours(model, spec, cal, ev, fp, steps) -> dict:
    recipe = qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"], steps=steps)
    t = time.perf_counter()
    with torch.no_grad():
        qm = bridge.quantize(model, recipe, calibration=[c for c in cal.split(4)], kernel="dequant")
    seconds = time.perf_counter() - t
    with torch.no_grad():
        ppl = evaluate.perplexity(qm, ev).perplexity
    return {"ppl": round(ppl, 3), "ratio": round(ppl / fp, 4), "seconds": round(seconds, 1)}


def peer(python: str, scheme: str, files: tuple[str, str, str], threads: int, method: str = "gptq") -> dict | None:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        cmd = [python, str(HERE / "peer_llmcompressor.py"), "--model", files[2], "--tokens", files[0],
               "--eval", files[1],
               "--scheme", scheme, "--threads", str(threads), "--out", out, "--method", method]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            print(f"llm-compressor {method} {scheme}: failed ({done.returncode}): {done.stderr.strip()[-400:]}", flush=True)
            return None
        return json.loads(pathlib.Path(out).read_text())


def main() -> None:
    ap = arguments(SCHEMES)
    ap.add_argument("--hqq", action="store_true", help="also compare HQQ-initialised GPTQ at 3 and 2 bits")
    ap.add_argument("--gptaq", action="store_true", help="also run GPTAQ at uint4/uint3 asym g64")
    a = ap.parse_args()
    load_before = os.getloadavg()[0]
    model, cal, ev, fp, files = setup(a)
    rows, gptaq_rows = [], []
    for name in a.only or list(SCHEMES):
        rtn = ours(model, spec_of(name), cal, ev, fp, [])
        mine = ours(model, spec_of(name), cal, ev, fp, [qt.Step("gptq")])
        other = peer(a.peer_python, name, files, a.threads) if a.peer_python else None
        quark, llmc, goal = ANCHORS.get(name, ("", "", ""))
        row = {"scheme": name, "rtn": rtn["ratio"], "ours": mine["ratio"], "ours_s": mine["seconds"],
               "llmc": None if other is None else round(other["ppl"] / fp, 4),
               "llmc_s": None if other is None else round(other["seconds"], 1),
               "quark_anchor": quark, "llmc_anchor": llmc, "goal": goal}
        row["time_ratio"] = None if other is None else round(mine["seconds"] / other["seconds"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.gptaq and name in GPTAQ_SCHEMES:
            asym = ours(model, spec_of(name), cal, ev, fp, [qt.Step("gptq", gptaq=True)])
            gptaq_rows.append({"scheme": f"{name} gptaq", "gptq": mine["ratio"], "gptq_s": mine["seconds"],
                               "gptaq": asym["ratio"], "gptaq_s": asym["seconds"]})
            print(json.dumps(gptaq_rows[-1]), flush=True)
    if not a.gptaq and not a.hqq:  # schemes of an earlier run that this one (--only) did not repeat stay
        rows = merged("gptq", rows, list(SCHEMES))
    table = markdown(["scheme", "RTN", "GPTQ (ours)", "ours, s", "llm-compressor (same run)", "llmc, s",
                      "time ours / llmc", "goal", "Quark anchor", "llmc anchor"],
                     [[r["scheme"], f"x{r['rtn']}", f"x{r['ours']}", r["ours_s"], _x(r["llmc"]), r["llmc_s"] or "-",
                       r["time_ratio"] or "-", r["goal"] or "-", r["quark_anchor"] or "-", r["llmc_anchor"] or "-"]
                      for r in rows])
    hqq_rows = hqq_comparison(model, cal, ev, fp) if a.hqq else []
    if hqq_rows:
        table += "\n\n" + markdown(["scheme (float zero point, g64)", "GPTQ (default init: clip)", "GPTQ HQQ init",
                                    "HQQ alone"],
                                   [[r["scheme"], f"x{r['clip']}", f"x{r['hqq_init']}", f"x{r['hqq']}"]
                                    for r in hqq_rows])
    if gptaq_rows:
        table += "\n\n" + markdown(["scheme", "GPTQ", "GPTQ, s", "GPTAQ (alpha 0.25)", "GPTAQ, s"],
                                   [[r["scheme"].removesuffix(" gptaq"), f"x{r['gptq']}", r["gptq_s"],
                                     f"x{r['gptaq']}", r["gptaq_s"]] for r in gptaq_rows])
    table += (f"\n\nfloat perplexity {fp:.3f} on {ev.numel()} tokens; calibration {a.calib}x{a.seq_len} tokens; "
              f"{a.threads} threads; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    write("gptaq" if a.gptaq else "gptq", rows + hqq_rows + gptaq_rows, table,
          {"fp_ppl": fp, "load_average": os.getloadavg()[0], "load_before": load_before})


def arguments(schemes) -> argparse.ArgumentParser:
    """The options both SmolLM2 benches take (calibration and evaluation sizes, threads, the peer, schemes)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", type=int, default=40)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-python", default=None, help="python of a virtualenv with llmcompressor")
    ap.add_argument("--only", nargs="*", default=None, help=f"schemes (default: all of {list(schemes)})")
    return ap


def setup(a) -> tuple:
    """Threads, the default model, evaluation and calibration tokens (the built-in corpus's two parts), the float
    perplexity, and the files a peer reads: ``(calib.pt, eval.pt, model directory)`` (the model written only
    with ``a.peer_python``)."""
    torch.set_num_threads(a.threads)
    model, tok = models.load_with_tokenizer()
    model.eval()
    ev = corpus.token_sequences(corpus.load_text("builtin", part="eval"), tok, seq_len=a.seq_len, max_sequences=a.eval)
    cal = corpus.token_sequences(corpus.load_text("builtin", part="calibration"), tok, seq_len=a.seq_len,
                                 max_sequences=a.calib)
    with torch.no_grad():
        fp = evaluate.perplexity(model, ev).perplexity
    tmp = tempfile.mkdtemp()
    files = (os.path.join(tmp, "calib.pt"), os.path.join(tmp, "eval.pt"), os.path.join(tmp, "model"))
    torch.save(cal.clone(), files[0])
    torch.save(ev.clone(), files[1])
    if a.peer_python:
        save_float(model, tok, files[2])  # the same float weights, as a transformers directory
    return model, cal, ev, fp, files


def hqq_comparison(model, cal, ev, fp) -> list[dict]:
    out = []
    for bits in (3, 2):
        spec = qt.QuantSpec(format=f"uint{bits}", granularity=qt.PerGroup(64), symmetric=False, pad=True,
                            zero_point_domain="float", scale_dtype="float16")
        row = {"scheme": f"uint{bits}-asym-g64 (float zp)"}
        for key, steps in (("clip", [qt.Step("gptq")]), ("hqq_init", [qt.Step("gptq", init="hqq")]),
                           ("hqq", [qt.Step("hqq", error_norm=4.0)])):
            row[key] = ours(model, spec, cal, ev, fp, steps)["ratio"]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def save_float(model, tok, directory: str) -> None:
    """The float model as a plain transformers directory (a GGUF-loaded model refuses save_pretrained)."""
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    pathlib.Path(directory, "config.json").write_text(json.dumps(config, indent=2))
    seen, tensors = set(), {}
    for name, t in model.state_dict().items():  # tied weights once (lm_head is the embedding)
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(directory)


def _x(v) -> str:
    return "-" if v is None else f"x{v}"


if __name__ == "__main__":
    main()
