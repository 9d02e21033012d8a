"""Fuzzing of the importers (issue 35): a few hundred damaged copies of tiny-Llama exports written by our own
exporters (Quark int4 and fp8, compressed-tensors int4, int8 and fp8, GGUF Q8_0 and Q4_0), each loaded with
``bridge.load(copy, like=model)``. Every load must end in

- ``error``: a ``CheckpointError``/``ValueError``/``TypeError``/``OSError`` of at most two lines naming the
  file, a tensor or a key; or
- ``same``: the undamaged export's logits (the damage was harmless: padding, a dropped digest list).

Anything else fails the test, listed one line per case: ``crash`` (another exception type), ``vague`` (an
accepted type, but long or naming nothing) and ``wrong`` (loads and runs with other logits).

Each case is ``<export>-<n>``: its mutation kind is the n-th of the format's list (round robin) and every
other choice comes from ``random.Random(case id)``, so a case is the same damage on every run. Run one case
with ``QT_FUZZ_CASE=quark-int4-017``; ``QT_FUZZ_N`` sets the cases per export; ``-s`` prints the counts of
each outcome per mutation kind."""

import json
import os
import random
import shutil
from collections import Counter

import pytest
import torch
from bridge_util import tiny_causal_lm
from interop.compressed_tensors.helpers import batches, recipe, tiny
from interop.fuzz_helpers import SAFETENSORS_MUTATIONS, classify, edit_config, fingerprint, logits, names_of

import bridge
from bridge import interop

gguf = pytest.importorskip("gguf")
from bridge.interop.gguf import tensors as gguf_tensors  # noqa: E402
from interop import fuzz_gguf  # noqa: E402

IDS = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
N = int(os.environ.get("QT_FUZZ_N", "36"))
ONLY = os.environ.get("QT_FUZZ_CASE")
D = "<delete>"

QUARK_EDITS = [(("global_quant_config", "weight", "dtype"), ["int4", "uint4", "int8", "fp8_e4m3", "bogus", None, D]),
               (("global_quant_config", "weight", "group_size"), [16, 64, 0, None, "32", D]),
               (("global_quant_config", "weight", "qscheme"), ["per_channel", "per_tensor", "per_group", "x"]),
               (("global_quant_config", "weight", "ch_axis"), [0, 1, -1, None]),
               (("global_quant_config", "weight", "symmetric"), [True, False, None]),
               (("global_quant_config", "weight"), [None, {}, D]),
               (("global_quant_config", "input_tensors"), [None, D]),
               (("global_quant_config", "input_tensors", "dtype"), ["int8", "fp8_e5m2", "uint4"]),
               (("global_quant_config",), [None, D]),
               (("exclude",), [[], None, ["lm_head", "model.layers.0.mlp.down_proj"]]),
               (("qtransform",), [None, D]), (("qtransform", "specs"), [[], D]),
               (("kv_cache_quant_config",), [{}, D]), (("export", "pack_method"), ["order", None]),
               (("layer_quant_config",), [{"model.layers.0.mlp.down_proj": None}, None])]
W = ("config_groups", "group_0", "weights")
A = ("config_groups", "group_0", "input_activations")
CT_FORMATS = ["pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "bogus"]
CT_EDITS = [(W + ("num_bits",), [3, 2, 8, 16, 0, None, "4", D]), (W + ("group_size",), [16, 64, 0, None, D]),
            (W + ("strategy",), ["channel", "tensor", "group", "block", "x", D]),
            (W + ("type",), ["int", "float", "x"]), (W + ("symmetric",), [True, False]),
            (("config_groups", "group_0", "format"), CT_FORMATS), (("format",), CT_FORMATS),
            (("config_groups", "group_0", "targets"), [[], ["Embedding"], ["re:.*down_proj"], None]),
            (W, [None, D]), (A, [None, D]), (A + ("num_bits",), [4, 16]), (A + ("dynamic",), [False]),
            (A + ("strategy",), ["tensor", "channel"]), (("config_groups",), [{}, None, D]),
            (("ignore",), [[], None, ["lm_head", "model.layers.0.mlp.down_proj"]]),
            (("kv_cache_scheme",), [{"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True}]),
            (("quantization_status",), ["frozen", "initialized", None])]


def _quark_config(d, rng):
    return edit_config(d, rng, [(("quantization_config",) + p, v) for p, v in QUARK_EDITS])


def _ct_config(d, rng):
    return edit_config(d, rng, [(("quantization_config",) + p, v) for p, v in CT_EDITS])


# export name -> (format, recipe name or GGUF type)
EXPORTS = {"quark-int4": ("quark", "int4-g32-asym"), "quark-fp8": ("quark", "fp8-static-kv"),
           "ct-int4": ("compressed-tensors", "int4-g32"), "ct-int8": ("compressed-tensors", "w8a8-int8-dynamic"),
           "ct-fp8": ("compressed-tensors", "fp8-dynamic"), "gguf-q8_0": ("gguf", "Q8_0"),
           "gguf-q4_0": ("gguf", "Q4_0")}
MUTATIONS = {"quark": SAFETENSORS_MUTATIONS + [_quark_config] * 2,
             "compressed-tensors": SAFETENSORS_MUTATIONS + [_ct_config] * 2, "gguf": fuzz_gguf.GGUF_MUTATIONS}


def _like():
    """The model to load into: the exported one's structure, other random values (a tensor taken from ``like``
    instead of the file changes the logits)."""
    torch.manual_seed(7)
    model = tiny_causal_lm("llama").eval()
    model.config.architectures = [type(model).__name__]
    return model


def _kind(fn):
    return fn.__name__.lstrip("_")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A builder of the undamaged exports (each made once): name -> (directory, like, reference)."""
    root, cache = tmp_path_factory.mktemp("fuzz"), {}

    def get(name):
        if name not in cache:
            to, what = EXPORTS[name]
            model = tiny("llama")
            if to == "gguf":
                q = bridge.quantize(model, gguf_tensors.IMPORT_SPECS[what])
            else:
                r = recipe(what)
                static = (r.input is not None and not r.input.dynamic) or r.kv_cache is not None
                q = bridge.quantize(model, r, calibration=batches() if static else None)
            bridge.save(q, root / f"{name}-ck")
            out = interop.export(root / f"{name}-ck", to=to, out=root / name)
            like = _like()
            ref_model = bridge.load(out, like=like)
            ref = {"fingerprint": fingerprint(ref_model), "logits": logits(ref_model, IDS), "ids": IDS}
            names = names_of(out) | (fuzz_gguf.names_of(out) if to == "gguf" else set())
            names |= set(like.state_dict()) | {n for n, _ in like.named_modules() if "." in n or n == "lm_head"}
            cache[name] = (out, like, ref, names)
        return cache[name]

    yield get, root


def _cases(fmt):
    out = []
    for name, (to, _) in EXPORTS.items():
        if to == fmt:
            out += [f"{name}-{i:03d}" for i in range(N)]
    return [c for c in out if ONLY is None or c == ONLY]


def run_case(case, get, root):
    """``(kind, what was done, outcome, detail)`` of one case."""
    name, i = case.rsplit("-", 1)
    src, like, ref, names = get(name)
    fns = MUTATIONS[EXPORTS[name][0]]
    fn, rng = fns[int(i) % len(fns)], random.Random(case)
    d = root / "cases" / case
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d)
    try:
        what = fn(d, rng)
    except Exception as e:  # a mutation that does not apply to this export is the harness's bug
        raise AssertionError(f"{case}: mutation {_kind(fn)} failed: {type(e).__name__}: {e}") from e
    outcome, detail = classify(d, like, ref, names)
    shutil.rmtree(d, ignore_errors=True)
    return _kind(fn), what, outcome, detail


def _fuzz(fmt, made):
    get, root = made
    cases = _cases(fmt)
    if not cases:
        pytest.skip(f"QT_FUZZ_CASE={ONLY} is not a {fmt} case")
    rows = [(c, *run_case(c, get, root)) for c in cases]
    counts = Counter(r[3] for r in rows)
    per_kind = {}
    for _, kind, _, outcome, _ in rows:
        per_kind.setdefault(kind, Counter())[outcome] += 1
    print(f"\n{fmt}: {len(rows)} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for kind, c in per_kind.items():
        print(f"  {kind:18} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    if os.environ.get("QT_FUZZ_REPORT"):  # every row, as JSON lines (for comparing runs)
        with open(os.environ["QT_FUZZ_REPORT"], "a") as f:
            f.writelines(json.dumps(dict(zip(("case", "kind", "what", "outcome", "detail"), r))) + "\n" for r in rows)
    if ONLY:
        print("\n".join(f"  {r}" for r in rows))
    bad = [r for r in rows if r[3] not in ("error", "same")]
    table = "\n".join(f"{c:16} {kind:16} {outcome:6} {what[:70]:70} | {detail[:110]}"
                      for c, kind, what, outcome, detail in bad)
    if bad:
        pytest.fail(f"{len(bad)} of {len(rows)} {fmt} imports were not safe "
                    f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}):\n{table}", pytrace=False)


def test_fuzz_quark(made):
    _fuzz("quark", made)


def test_fuzz_compressed_tensors(made):
    _fuzz("compressed-tensors", made)


def test_fuzz_gguf(made):
    _fuzz("gguf", made)


# ------------------------------------------------------------------------------------------ the command
# a few cases of each format (stable ids), given to `qtransform inspect` in this process (a subprocess each
# would cost seconds): a failure is an exception out of main() or a non-zero exit with more than one line
CLI_CASES = ["quark-int4-000", "quark-int4-003", "quark-fp8-028", "quark-fp8-012", "ct-int4-008", "ct-int8-000",
             "ct-fp8-002", "gguf-q8_0-000", "gguf-q8_0-009", "gguf-q4_0-004", "gguf-q4_0-018"]


def test_inspect_of_damaged_exports(made, capsys):
    from bridge.app import cli

    get, root = made
    bad = []
    for case in CLI_CASES:
        name, i = case.rsplit("-", 1)
        fns = MUTATIONS[EXPORTS[name][0]]
        fn, d = fns[int(i) % len(fns)], root / "cli" / case
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(get(name)[0], d)
        what = fn(d, random.Random(case))
        capsys.readouterr()
        try:
            rc = cli.main(["inspect", str(d)])
        except Exception as e:  # noqa: BLE001 - the command would print a traceback
            bad.append(f"{case:16} {what[:60]:60} | traceback: {type(e).__name__}: {str(e)[:80]}")
            continue
        err = capsys.readouterr().err.strip()
        lines = err.splitlines()
        if rc != 0 and (len(lines) != 1 or not lines[0].startswith("qtransform: error:") or "Traceback" in err):
            bad.append(f"{case:16} {what[:60]:60} | exit {rc}, {len(lines)} lines: {err[:80]!r}")
    if bad:
        pytest.fail(f"{len(bad)} of {len(CLI_CASES)} `qtransform inspect` of damaged exports failed:\n"
                    + "\n".join(bad), pytrace=False)
