"""Tiny random models of every causal-LM and image-text-to-text type transformers registers (issue 51, part 6).

``ENTRIES``: ``{entry id: Entry}`` computed at import from transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, so a new release adds its types itself. A type in both mappings with
two classes (``Llama4ForCausalLM`` and ``Llama4ForConditionalGeneration``) is two entries, ``llama4`` and
``llama4-vlm``; a causal class whose config is the text part of a composite one (``Qwen3_5ForCausalLM``) gets that
part, as ``AutoModelForCausalLM`` gives it.

:func:`tiny_config` shrinks every size field of the type's default config by its name, sub-configs too (the rules
of :func:`moe.tiny_moe._small_value` and :mod:`tiny_vlm`, plus the few spellings they miss: GPT-2's ``n_head``,
partial rotary ``rotary_dim``...); ``OVERRIDES`` has the per-type fixes. :func:`build` refuses a config whose model
would have more than ``MAX_PARAMS`` parameters (counted on the meta device) before allocating anything, then builds
an ``eval()`` model with deterministic finite random weights.

``SEQ2SEQ``: the same for ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` and ``MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES``
(encoder-decoder text and speech models, and the decoders with an audio tower registered there); :func:`inputs` gives
each its own inputs (``decoder_input_ids``, audio features of the shape its encoder expects).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as S2S
from transformers.models.auto.modeling_auto import MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES as SPEECH

from moe.tiny_moe import _OVERRIDES as MOE_OVERRIDES
from moe.tiny_moe import _reinit, _small_value
from tiny_vlm import _VISION

#: a tiny config whose model is larger than this is a bug of the shrinking (a size field it missed)
MAX_PARAMS = 20_000_000


class Entry(NamedTuple):
    """One model class to walk: its ``model_type``, class name and the mapping that registers it."""

    model_type: str
    class_name: str
    mapping: str  # "causal", "vlm", "seq2seq" or "speech"


def _entries() -> dict[str, Entry]:
    out = {}
    for mt in sorted(set(CAUSAL) | set(VLM)):
        if mt in CAUSAL:
            out[mt] = Entry(mt, CAUSAL[mt], "causal")
        if mt in VLM and VLM[mt] != CAUSAL.get(mt):
            out[f"{mt}-vlm" if mt in CAUSAL else mt] = Entry(mt, VLM[mt], "vlm")
    return out


ENTRIES = _entries()


def _seq2seq() -> dict[str, Entry]:
    """The seq2seq and speech-seq2seq classes: an entry id already in :data:`ENTRIES` gets ``-s2s`` (or
    ``-speech``); a type in both mappings with one class is one entry."""
    out = {}
    for mt in sorted(set(S2S) | set(SPEECH)):
        for mapping, names, tail in (("seq2seq", S2S, "-s2s"), ("speech", SPEECH, "-speech")):
            cls = names.get(mt)
            if cls is None or (mapping == "speech" and S2S.get(mt) == cls):
                continue
            taken = mt in ENTRIES or mt in out
            out[f"{mt}{tail}" if taken else mt] = Entry(mt, cls, mapping)
    return out


#: every encoder-decoder (text and speech) class transformers registers, by entry id
SEQ2SEQ = _seq2seq()

#: per-type fixes where shrinking by name is not enough: fields given to the config (top level, or
#: ``{"text_config": {...}}`` merged into a sub-config), on top of :data:`moe.tiny_moe._OVERRIDES`
_MROPE = {"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}}}  # the modeling default: a big head's
_CODEC = {"num_filters": 4, "depths": [1] * 7}  # VibeVoice's audio tokenizers: channels double at each of 7 stages
_BY_LAYER = {"rope_type": "default", "rope_theta": 10000.0}

#: per-type fixes where shrinking by name is not enough: fields given to the config (sub-config dicts merged), on
#: top of :data:`moe.tiny_moe._OVERRIDES`; 2 layers, hidden <= 128 everywhere but Zamba (3: its shared block)
OVERRIDES: dict[str, dict] = {
    **{t: _MROPE for t in ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker", "paddleocr_vl", "glm4v", "glm46v",
                           "glm_ocr", "glmga")},
    "glm4v_moe": {"text_config": {"rope_parameters": {"mrope_section": [1, 1, 2]}}},  # partial rotary: 8 dims
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}}},
    "hunyuan_vl": {"text_config": {"rope_parameters": {"mrope_section": [2, 2, 2, 2]}}},
    "bamba": {"attn_layer_indices": [1]},  # default: both tiny layers Mamba, no attention layer for the mask
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # default: both tiny layers attention
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},  # tied blocks
    "mamba2": {"num_heads": 8},  # hidden * expand == num_heads * head_dim
    "nemotron": {"num_key_value_heads": 2},  # default None, needed
    "xlstm": {"num_blocks": 2, "hidden_size": 128, "embedding_dim": 128},  # qk head 8 (hidden 64) fails its step
    "hrm_text": {"num_layers_per_stack": 1, "H_cycles": 1, "L_cycles": 1, "L_bp_cycles": [1]},  # 1 * 1 * (1 + 1)
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 0, "n_output_layers": 1},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": (16, 48), "axial_pos_shape": (4, 8),
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8},
    "qwen4_exp": {"text_config": MOE_OVERRIDES["qwen4_exp_text"]},
    "cohere_compass_text": {"rope_parameters": {"full_attention": _BY_LAYER, "sliding_attention": _BY_LAYER}},
    "cohere_compass": {"text_config": {"rope_parameters": {"full_attention": _BY_LAYER,
                                                           "sliding_attention": _BY_LAYER}}},
    "step3p7": {"text_config": {"sliding_window": 16}},
    "mistral_large4": {"text_config": {"kv_source_layers": [0, 1]}},
    "glm5_next": {"text_config": {"index_kpool": 4}},
    "zaya": {"num_experts_per_tok": 1},  # the only value ZAYA supports
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma4_unified_assistant": {"text_config": {"num_kv_shared_layers": 2}},  # all, as the default
    "dots3_note_text": {"head_dim": 16},  # sliding layers: qk_nope + qk_rope
    "dots3_note": {"text_config": {"per_layer_config": {}, "head_dim": 16}},
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    "granite4_vision": {"deepstack_layer_map": [[1, 0]], "downsample_rate": "1/2"},
    "chameleon": {"vocabulary_map": {"<image>": 250}},
    "emu3": {"vocabulary_map": {"<image>": 250}},
    "janus": {"vq_config": {"projection_dim": 64}},
    "florence2": {"vision_config": {"depths": [1, 1, 1, 1], "embed_dim": [16, 32, 32, 64], "num_heads": [1, 2, 2, 4],
                                    "num_groups": [1, 2, 2, 4]}},
    "nemotron_h_omni": {"vision_config": {"max_img_size": 64},
                        "text_config": {"mamba_num_heads": 8, "ssm_state_size": 16, "n_groups": 1}},
    "molmo2": {"adapter_config": {"vision_feature_layer": [1, 0]}},
    "muse_spark": {"audio_config": {"num_hidden_layers": 4, "hidden_sizes": [16, 16, 32, 32]}},  # 4 audio stages
    # seq2seq and speech (SEQ2SEQ)
    "whisper": {"max_source_positions": 32},  # 64 input frames, not 3000
    "dia": {"delay_pattern": [0, 8], "decoder_config": {"num_channels": 2, "cross_hidden_size": 64}},
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": 16}},  # text hidden // 4
    "nemo_speechlm": {"head_config": {"audio_hidden_size": 64}},
    "moonshine_streaming": {"num_key_value_heads": 4},
    **{t: {"encoder_config": {"hidden_dim": 64, "num_layers": 2, "dim_head": 16}} for t in ("granite_speech",
                                                                                          "granite_speech_plus")},
    **{t: {f"{k}_tokenizer_encoder_config": _CODEC for k in ("acoustic", "semantic")} for t in ("vibevoice_asr",)},
    "vibevoice": {"audio_config": _CODEC, "semantic_model_config": _CODEC,
                  "diffusion_head_config": {"hidden_size": 64, "intermediate_size": 32}},
    "apertus1p5": {"image_token_id": 10, "audio_token_id": 11, "image_token_offset": 100, "audio_token_offset": 164,
                   "audio_config": {"codebook_dim": 64, "decoder_num_layers": 2, "decoder_hidden_size": 64,
                                    "codebook_size": 64, "decoder_attention_num_groups": 4},
                   "vision_config": {"codebook_size": 64}},
}

#: width fields that the shared rules miss (they go to ``hidden``)
_WIDTHS = ("emb_dim", "embed_dim", "embedding_dim", "d_embed", "n_embed", "text_hidden_size", "hidden_size_global",
           "image_token_embed_dim", "word_embed_proj_dim", "projector_hidden_size",
           "adapter_in_dim", "adapter_input_size", "adapter_out_dim")
#: depth fields that the shared rules miss (they go to ``layers``)
_DEPTHS = ("encoder_layers", "decoder_layers", "num_encoder_layers", "num_decoder_layers", "n_layers")
#: the sizes of a tiny VQ-GAN (32 channels: its group norms have 32 groups)
_VQ = {"base_channels": 32, "channel_multiplier": [1, 2], "num_res_blocks": 1, "latent_channels": 8}
_HEADS = re.compile(r"^(n_head|num_heads|n_heads|encoder_attention_heads|decoder_attention_heads|"
                    r"num_attention_heads|attention_heads)$")


def _small(name: str, value, d: dict, *, hidden: int, layers: int, vocab: int, intermediate: int):
    n = name.lower()
    if isinstance(value, bool) or name.startswith("_") or value == 0:  # a size of 0 turns a part off: kept
        return value
    if name in _VISION and isinstance(value, int):
        return _VISION[name]
    if _HEADS.match(n) and isinstance(value, int):
        return 4
    if n == "rotary_dim" and isinstance(value, int):  # partial rotary: within the head
        return 8
    if isinstance(value, int) and n in _WIDTHS:
        return hidden
    if isinstance(value, int) and (n.endswith("ffn_dim") or n in ("d_ff", "n_inner", "ffn_hidden_size")):
        return intermediate
    if isinstance(value, int) and n in _DEPTHS and value > layers:
        return layers
    if isinstance(value, int) and ("vocab" in n or n in ("num_embeddings", "codebook_size")):
        return min(value, vocab)
    if n in _VQ:  # the image tokenizers (VQ-GAN) of Chameleon, Emu3, Janus
        return _VQ[n] if isinstance(value, type(_VQ[n])) and value != _VQ[n] else value
    if isinstance(value, list) and "pattern" in n and len(value) > layers:  # one entry per layer
        return value[:layers]
    heads = d.get(name.replace("key_value", "attention").replace("kv_", ""), 1 << 30)
    new = _small_value(name, value, heads=heads if isinstance(heads, int) else 1 << 30, experts=4, top_k=2,
                       hidden=hidden, layers=layers, vocab=vocab)
    if n.endswith("intermediate_size") and isinstance(value, int) and not isinstance(new, list):
        return intermediate
    return new


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _per_layer(d: dict) -> bool:
    return bool(d) and all(str(k).isdigit() for k in d)


def _sections(rope: dict, d: dict, out: dict) -> list[int]:
    """Multimodal rotary sections (time, height, width) scaled to half the shrunk rotary dimension."""
    base = rope["mrope_section"]
    dim = out.get("qk_rope_head_dim") or out.get("head_dim") or d.get("head_dim") and 16 or 16
    factor = rope.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0
    half = max(int(dim * factor) // 2, len(base))
    new = [max(1, int(x * half / sum(base))) for x in base]
    new[0] += half - sum(new)
    return new


def _shrink(d: dict, *, hidden: int = 64, layers: int = 2, vocab: int = 256, intermediate: int = 32) -> dict:
    """The fields of config dict ``d`` made small by name (sub-config dicts too), only those that change."""
    out = {}
    for name, value in d.items():
        if name.startswith("_") or name in ("model_type", "transformers_version", "architectures"):
            continue
        if isinstance(value, dict):  # a sub-config (not a per-layer table keyed by layer index)
            if ("model_type" in value or name.endswith("_config")) and not _per_layer(value):
                sub = {k: v for k, v in value.items() if not (isinstance(v, dict) and _per_layer(v))}
                out[name] = {**sub, **_shrink(value, hidden=hidden, layers=layers, vocab=vocab,
                                              intermediate=intermediate)}
            elif isinstance(value.get("mrope_section"), list):  # rotary sections of the (smaller) head
                out[name] = {**value, "mrope_section": _sections(value, d, out)}
            continue
        new = _small(name, value, d, hidden=hidden, layers=layers, vocab=vocab, intermediate=intermediate)
        if new is not value and new != value:
            out[name] = new
    if d.get("qk_rope_head_dim"):  # MLA: head_dim is the rope part; keep the family's ratio
        ratio = (d.get("head_dim") or d["qk_rope_head_dim"]) // d["qk_rope_head_dim"]
        rope = out.get("qk_rope_head_dim", d["qk_rope_head_dim"])
        out["head_dim"] = rope * max(ratio, 1)
        if "qk_head_dim" in d:
            out["qk_head_dim"] = rope + out.get("qk_nope_head_dim", 8)
    return out


def tiny_config(entry: Entry):
    """The config of ``entry`` with every size small (see the module docstring)."""
    cls = CONFIG_MAPPING[entry.model_type]
    default = cls().to_dict()
    small = _shrink(default, intermediate=128 if entry.mapping == "vlm" else 32)
    small = _merge(small, MOE_OVERRIDES.get(entry.model_type, {}))
    small = _merge(small, OVERRIDES.get(entry.model_type, {}))
    try:
        config = cls(**small)
    except TypeError:  # a constructor that takes a field under another name: set them afterwards
        config = cls()
        for name, value in small.items():
            if not isinstance(value, dict):
                setattr(config, name, value)
    for name, value in small.items():  # constructors that ignore or recompute a field
        try:
            if not isinstance(value, dict) and getattr(config, name, None) != value:
                setattr(config, name, value)
        except Exception:  # noqa: BLE001  (a per-layer attribute that raises on read: the constructor set it)
            pass
    config._attn_implementation = "eager"
    model_cls = model_class(entry)
    want = getattr(model_cls, "config_class", None)
    if entry.mapping == "causal" and want is not None and not isinstance(config, want):
        # a causal class of a composite type: its part (the text config; MusicGen's decoder)
        parts = [v for v in vars(config).values() if isinstance(v, want)]
        config = parts[0] if len(parts) == 1 else config.get_text_config()
        config._attn_implementation = "eager"
    return config


def model_class(entry: Entry) -> type:
    return getattr(transformers, entry.class_name)


def build(entry: Entry, seed: int = 0):
    """An ``eval()`` tiny model of ``entry`` with deterministic random finite weights (none constant)."""
    config = tiny_config(entry)
    cls = model_class(entry)
    with torch.device("meta"):
        skeleton = cls(config)
    n = sum(p.numel() for p in skeleton.parameters())
    if n > MAX_PARAMS:
        raise AssertionError(f"{entry.model_type}: the tiny config builds {n} parameters (> {MAX_PARAMS}): a size "
                             "field the shrinking missed")
    torch.manual_seed(seed)
    model = cls(config)
    _reinit(model, seed)
    languages = getattr(config, "languages", None)
    if hasattr(model, "set_default_language") and languages:  # X-MOD: an adapter per language
        model.set_default_language(languages[0])
    return model.eval()


def tokens(model, batch: int = 1, length: int = 16, seed: int = 1) -> torch.Tensor:
    """Token ids within the model's vocabulary (a text-only batch)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = getattr(config, "vocab_size", None) or 256
    return torch.randint(0, min(vocab, 200), (batch, length), generator=torch.Generator().manual_seed(seed))


def _frames(n: int, width_of):
    return lambda c: (n, width_of(c))


#: the encoder's audio input of a speech class: ``class name: (argument, its shape without the batch from config)``
_AUDIO = {
    "WhisperForConditionalGeneration": ("input_features", lambda c: (c.num_mel_bins, 2 * c.max_source_positions)),
    "Speech2TextForConditionalGeneration": ("input_features", _frames(32, lambda c: c.input_feat_per_channel
                                                                      * c.input_channels)),
    "SeamlessM4TForSpeechToText": ("input_features", _frames(32, lambda c: c.feature_projection_input_dim)),
    "SeamlessM4Tv2ForSpeechToText": ("input_features", _frames(32, lambda c: c.feature_projection_input_dim)),
    "CanaryForConditionalGeneration": ("input_features", _frames(64, lambda c: c.encoder_config.num_mel_bins)),
    "CohereAsrForConditionalGeneration": ("input_features", _frames(64, lambda c: c.encoder_config.num_mel_bins)),
    "Pop2PianoForConditionalGeneration": ("input_features", _frames(16, lambda c: c.d_model)),  # encoder embeddings
    "MoonshineForConditionalGeneration": ("input_values", lambda c: (4000,)),  # raw audio samples
    "SpeechT5ForSpeechToText": ("input_values", lambda c: (4000,)),
    "SpeechEncoderDecoderModel": ("input_values", lambda c: (4000,)),
    "MoonshineStreamingForConditionalGeneration": ("input_values", lambda c: (4000,)),
    # no cross-attention: the audio is added to the token embeddings, 8 frames per token
    "VoxtralRealtimeForConditionalGeneration": ("input_features", lambda c: (c.audio_config.num_mel_bins, 8 * 16)),
}


def inputs(model, batch: int = 1, seed: int = 1) -> dict:
    """The model's inputs as keyword arguments: an encoder-decoder model gets its encoder's input (token ids, or
    audio: input features of the shape its encoder expects, raw samples) and ``decoder_input_ids`` (16 tokens: a
    batch of 2 is 32 rows, where the CPU int4 kernels compute in float32 as the walk over causal LMs has them); a
    decoder with an audio tower (no cross-attention) gets token ids only."""
    ids, audio = tokens(model, batch, 16, seed), _AUDIO.get(type(model).__name__)
    if not getattr(model.config, "is_encoder_decoder", False):
        out = {"input_ids": ids}
    elif type(model).__name__ == "DiaForConditionalGeneration":  # text in, audio codes out: one id per channel
        out = {"input_ids": ids, "decoder_input_ids": tokens(model, batch, 16 * model.config.decoder_config.num_channels,
                                                            seed + 100).view(batch, 16, -1)}
    else:
        out = {"decoder_input_ids": tokens(model, batch, 16, seed + 100)}
        out.update({} if audio else {"input_ids": ids})
    if audio is not None:
        name, shape = audio
        out[name] = torch.randn((batch, *shape(model.config)), generator=torch.Generator().manual_seed(seed))
    return out
