"""Issue 51, part 6: every model type transformers registers as a causal LM or an image-text-to-text model, built
tiny and random (hidden 64, 2 layers; :mod:`.tiny_any`), goes through the whole pipeline or is refused by name:

(a) ``int4-g32`` leaves every tensor of the float model quantized or kept in float by a deliberate plan rule
    (skipped, excluded, ndim, no rule for a non-linear module), unchanged, nothing dropped; a linear layer's weight
    (an ``nn.Linear`` subclass's too) kept in float by no rule is a failure;
(b) the quantized model's logits are transformers' own forward of the float model with the dequantized weights put
    back (a new parameter: a tied input embedding stays as the quantized model keeps it), within float32 noise;
(c) ``bridge.save`` then ``from_pretrained`` gives the same tensors and the same logits;
(d) the streamed driver writes the bytes of the in-memory command, or refuses by name (the command too, if it
    fails: one line);
(e) ``gptq4-g64`` calibrated on two tiny batches of token ids runs, or is refused by name.

Any other exception is a failure. The type list is computed at import (a new transformers release adds its types);
types that cannot be built here are in :data:`UNBUILDABLE`, those whose forward needs more than token ids in
:data:`NO_TEXT_FORWARD`, each with its exception, and the tests check they still fail that way (a fix is noticed).
Failures the walk found and this branch does not fix are :data:`KNOWN` (strict xfail, with the cause).
``SUBSET`` (one type per family kind) runs in ``make test``; the whole walk is marked long (``make test-long``, or
``make test-walk``). Each test records its outcome
and the model's family kind (``record_property``: ``--junitxml`` has them).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn

import bridge
import qtransform as qt
import tiny_lm
from cli_util import main_cli, one_line_error

from .tiny_any import ENTRIES, Entry, build, tokens
from .walk_checks import (KINDS, check_inventory, close, dequantized_copy, family, logits, named, quantized,
                          safetensors_of, same_tensors, same_trees)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")

RECIPE = qt.get_preset("int4-g32").recipe
GPTQ = qt.get_preset("gptq4-g64").recipe

#: one type per family kind, run by ``make test`` (the rest is marked long)
SUBSET = {"llama": "dense", "qwen3_moe": "moe", "qwen3_next": "linear-attention", "bamba": "mamba-hybrid",
          "llava": "vlm", "qwen3_5-vlm": "vlm", "gemma3_text": "sliding-window"}

_TIMM = "TimmWrapperModel requires the timm library"
#: entries that cannot be built here: {entry id: the exception's text (a part of it)}
UNBUILDABLE: dict[str, str] = {
    "fast_vlm": _TIMM, "perception_lm": _TIMM, "gemma3n": _TIMM,  # timm is not installed (not a dependency)
    # transformers' own default config fails its validation (its text part has per-layer inputs)
    "gemma4_assistant": "hidden_size_per_layer_input must be 0, got 256",
}

#: entries that build but whose forward on token ids alone fails here (images, audio codebooks, robot state, a
#: main model's states...): {entry id: the exception's text}. They walk (a) and (d); (b) and (c) check that the
#: forward still fails so (a fix is noticed) and compare the reloaded tensors only.
NO_TEXT_FORWARD: dict[str, str] = {
    "blip": "missing 1 required positional argument: 'pixel_values'",
    "blip-2": "missing 1 required positional argument: 'pixel_values'",
    "instructblip": "missing 2 required positional arguments: 'pixel_values' and 'qformer_input_ids'",
    "instructblipvideo": "missing 2 required positional arguments: 'pixel_values' and 'qformer_input_ids'",
    "idefics": "Exactly 1 of pixel_values, image_encoder_embeddings or perceiver_embeddings",
    "kosmos-2": "You have to specify either `pixel_values` or `image_embeds`",
    "pix2struct": "You have to specify flattened_patches",
    "pp_formulanet": "You must specify exactly one of encoder_outputs or pixel_values",
    "vision-encoder-decoder": "You have to specify pixel_values",
    "udop": "Bbox is required for horizontal relative position bias",
    "t5gemma2": "You must specify exactly one of input_ids or inputs_embeds",  # the decoder's
    "musicgen": "shape '[-1, 4, 16]' is invalid for input of size 16",  # ids interleave 4 audio codebooks
    "musicgen_melody": "shape '[-1, 4, 16]' is invalid for input of size 16",
    "pi0": "missing 1 required positional argument: 'state'",
    "pi05": "'NoneType' object has no attribute 'get_seq_length'",
    "gemma4_unified_assistant": "inputs_embeds and shared_kv_states cannot be None",  # a draft model's
    "blt": "'BltConfig' object has no attribute 'num_hidden_layers'",  # transformers' cache, any input
}

WALKED = [e for e in ENTRIES if e not in UNBUILDABLE]

#: failures found by the walk, not fixed here: {(entry id, check): the cause}; strict, so that a fix is noticed
KNOWN: dict[tuple[str, str], str] = {
}


def _known(request, entry: str, check: str) -> None:
    why = KNOWN.get((entry, check))
    if why is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=why))


class Walked(NamedTuple):
    id: str
    entry: Entry
    model: nn.Module
    kind: str
    plan: object | None
    qmodel: nn.Module | None  # None: refused (``refusal``) or crashed (``error``)
    refusal: str | None
    error: BaseException | None


def _params(ids):
    return [pytest.param(i, id=i, marks=() if i in SUBSET else pytest.mark.long) for i in ids]


@pytest.fixture(scope="module", params=_params(WALKED))
def walked(request):
    entry = ENTRIES[request.param]
    model = build(entry)
    kind = family(entry, model)
    try:
        plan = bridge.plan(model, RECIPE)
        qmodel = bridge.quantize(model, RECIPE, kernel="dequant")
    except ValueError as e:
        return Walked(request.param, entry, model, kind, None, None, str(e), None)
    except Exception as e:  # noqa: BLE001  (a crash: each test that needs the quantized model fails with it)
        return Walked(request.param, entry, model, kind, None, None, None, e)
    return Walked(request.param, entry, model, kind, plan, qmodel, None, None)


def _quantized(w: Walked, record_property) -> bool:
    record_property("kind", w.kind)
    return quantized(w, record_property)


def test_inventory_is_complete(walked, record_property):
    if _quantized(walked, record_property):
        kept = check_inventory(walked.model, walked.qmodel, walked.plan)
        record_property("outcome", "quantized")
        record_property("kept", "; ".join(kept))


def _no_text_forward(w: Walked, record_property) -> bool:
    """Whether ``w`` cannot run on token ids alone (:data:`NO_TEXT_FORWARD`), checked to still fail so."""
    why = NO_TEXT_FORWARD.get(w.id)
    if why is None:
        return False
    with pytest.raises(Exception) as info:
        logits(w.model, tokens(w.model))
    assert why in str(info.value), f"fails otherwise now ({type(info.value).__name__}: {info.value}): update the table"
    record_property("outcome", f"no text forward: {why}")
    return True


def test_logits_are_transformers_own_with_the_dequantized_weights(walked, record_property):
    if not _quantized(walked, record_property) or _no_text_forward(walked, record_property):
        return
    ids = tokens(walked.model, batch=2)
    close(logits(walked.qmodel, ids), logits(dequantized_copy(walked.model, walked.qmodel), ids))
    record_property("outcome", "quantized")


def test_save_then_from_pretrained_gives_the_same_model(walked, record_property, tmp_path, request):
    _known(request, walked.id, "reload")
    if not _quantized(walked, record_property):
        return
    bridge.save(walked.qmodel, tmp_path / "q")
    impl = walked.model.config._attn_implementation  # PaliGemma's sdpa and eager differ on a text-only batch
    reloaded = type(walked.model).from_pretrained(tmp_path / "q", attn_implementation=impl).eval()
    same_trees(bridge.extract(reloaded), bridge.extract(walked.qmodel))
    if _no_text_forward(walked, record_property):
        return
    ids = tokens(walked.model, batch=2)
    close(logits(reloaded, ids), logits(walked.qmodel, ids))
    record_property("outcome", "quantized")


def test_streamed_writes_the_in_memory_bytes_or_refuses_by_name(walked, record_property, tmp_path, request):
    _known(request, walked.id, "stream")
    record_property("kind", walked.kind)
    src = tmp_path / "src"
    walked.model.save_pretrained(src)
    tiny_lm.tokenizer().save_pretrained(src)
    res = main_cli("quantize", "--model", src, "--recipe", "int4-g32", "--out", tmp_path / "mem", "--no-eval",
                   "--in-memory")
    try:
        bridge.stream.quantize_checkpoint(src, tmp_path / "stream", RECIPE)
    except ValueError as e:  # CannotStream and CheckpointError too
        assert named(str(e), walked.model) or "stream" in str(e), f"refused without a reason: {e}"
        if res.returncode != 0:  # both drivers refuse the checkpoint: the command in one line, by name
            one_line_error(res)
        else:  # the command read the checkpoint: the streamed driver may refuse a run, not the checkpoint
            assert not isinstance(e, bridge.CheckpointError), f"the in-memory command read the checkpoint: {e}"
        record_property("outcome", f"refused: {type(e).__name__}: {e}")
        return
    assert res.returncode == 0, f"the streamed run wrote, the in-memory command failed: {res.stderr[-2000:]}"
    same_tensors(safetensors_of(tmp_path / "stream"), safetensors_of(tmp_path / "mem"))
    record_property("outcome", "quantized")


def test_calibrated_recipe_runs_or_is_refused_by_name(walked, record_property, request):
    _known(request, walked.id, "calibrated")
    record_property("kind", walked.kind)
    batches = [tokens(walked.model, seed=s) for s in (2, 3)]
    try:
        qmodel = bridge.quantize(walked.model, GPTQ, calibration=batches, kernel="dequant")
    except ValueError as e:
        assert named(str(e), walked.model, "gptq"), f"refused without naming the model or the step: {e}"
        record_property("outcome", f"refused: {e}")
        return
    assert any(isinstance(v, qt.QTensor) for v in bridge.extract(qmodel).values())
    if walked.id not in NO_TEXT_FORWARD:  # the calibration forward ran (no cache; a first stack only): the model's
        assert torch.isfinite(logits(qmodel, batches[0])).all()  # own forward on ids alone may still fail
    record_property("outcome", "quantized")


@pytest.mark.parametrize("entry", _params(UNBUILDABLE))
def test_unbuildable_types_still_fail_the_same_way(entry):
    with pytest.raises(Exception) as info:
        model = build(ENTRIES[entry])
        with torch.no_grad():
            model(input_ids=tokens(model))
    assert UNBUILDABLE[entry] in f"{type(info.value).__name__}: {info.value}", (
        f"{entry} fails otherwise now ({type(info.value).__name__}: {info.value}): update UNBUILDABLE")


def test_the_walk_covers_every_registered_type_and_the_subset_every_kind():
    known = set(UNBUILDABLE) | set(NO_TEXT_FORWARD) | {e for e, _ in KNOWN}
    assert len(ENTRIES) > 250 and known <= set(ENTRIES)  # no stale entry
    assert set(SUBSET) <= set(WALKED) and set(SUBSET.values()) == set(KINDS)
    for t in ("llama", "mixtral", "qwen3_next", "bamba", "llava", "qwen3_5-vlm", "gemma3_text", "deepseek_v4"):
        assert t in ENTRIES


@pytest.mark.parametrize("model_type", list(SUBSET))
def test_the_subset_covers_its_kind(model_type):
    entry = ENTRIES[model_type]
    assert family(entry, build(entry)) == SUBSET[model_type]
