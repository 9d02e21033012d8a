"""Helpers and tiny untrained models for the bridge tests (built from configs, no downloads)."""

from pathlib import Path

import torch
from torch import nn

#: The repository's root (README.md, docs/, pyproject.toml).
REPO = Path(__file__).resolve().parents[2]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bit-exact comparisons for every dtype, float8 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def decode(model, ids: torch.Tensor, cache=None):
    """``(logits, cache)`` of one forward with the KV cache on, ``cache`` from the previous call. The
    cache's argument and output field are ``cache`` in transformers 5.24, ``past_key_values`` in 5.17."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    out = model(ids, use_cache=True, **({} if cache is None else {name: cache}))
    return out.logits, out[name]


def tiny_causal_lm(arch: str):
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **common))
    if arch == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, **common))
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **common))
    if arch == "phi3":  # fused qkv_proj and gate_up_proj
        return tf.Phi3ForCausalLM(tf.Phi3Config(num_key_value_heads=2, pad_token_id=0, **common))
    if arch == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                              num_attention_heads=4, max_position_embeddings=64,
                                              word_embed_proj_dim=64))
    if arch == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    if arch == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                max_position_embeddings=64))
    raise ValueError(arch)


def tiny_llama_with_tokenizer(layers: int = 2, seed: int = 0):
    """``(model, tokenizer)``: a tiny untrained Llama over SmolLM2's tokenizer (tied embeddings), eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bridge.app import models

    tokenizer = models.load_tokenizer(None)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval(), tokenizer


def tiny_with_outliers(arch: str, seed: int = 0):
    """A tiny model (:func:`tiny_causal_lm`, eval mode) with random norm weights, a few channels x20
    (activation outliers), and random biases."""
    torch.manual_seed(seed)
    m = tiny_causal_lm(arch).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1 and name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() == 1:  # norm weights
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
                p[torch.randperm(p.numel(), generator=g)[:2]] *= 20
    return m


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect", groups=2, bias=False)
        self.up = nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv(x))))
        x = self.up(x)
        return self.head(x.mean(dim=(2, 3)))


class EmbedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32, padding_idx=0)
        self.bag = nn.EmbeddingBag(100, 32, mode="sum")
        self.out = nn.Linear(32, 16)

    def forward(self, tokens, bag_ids, offsets):
        return self.out(self.emb(tokens).mean(1) + self.bag(bag_ids, offsets))


def format_specs(group: int = 16) -> list:
    """One spec per (format, symmetric) the registry allows (groups of ``group`` where the format has no
    block of its own): adding a format adds test cases."""
    import qtransform as qt
    out = []
    for name, fmt in sorted(qt.FORMATS.items()):
        gran = fmt.default_granularity if fmt.block else qt.PerGroup(group)
        for sym in (True, False):
            try:
                out.append(qt.QuantSpec(format=name, granularity=gran, symmetric=sym))
            except ValueError:
                continue
    return out


def on_command_model(monkeypatch, fn) -> None:
    """Call ``fn(model)`` (under no_grad) with the model the ``qtransform quantize`` command holds in
    memory, just before it is written (``bridge.io.checkpoint_writer``)."""
    import bridge.io

    real = bridge.io.checkpoint_writer

    def writer(qmodel, *args, **kw):
        with torch.no_grad():
            fn(qmodel)
        return real(qmodel, *args, **kw)

    monkeypatch.setattr(bridge.io, "checkpoint_writer", writer)


def copy_export(src, dst, *, tensors=None, config=None, metadata=None):
    """A copy of the single-file export directory ``src`` in ``dst`` (``model.safetensors`` and
    ``config.json``), each edited by a function of its dict when given: ``tensors(stored)``,
    ``config(cfg)``, ``metadata(safetensors header metadata)`` (returning ``None`` drops it)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir()
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        meta, stored = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors(stored) if tensors else stored, str(dst / "model.safetensors"),
              metadata=metadata(meta) if metadata else meta)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    return dst


def w8a8_reference(m, x):
    """float64 ``(a - za) sa @ (b - zb) sb`` from the codes a W8A8 module's quantizers give its input ``x`` and
    weight (no bias), and the same over magnitudes (the accumulation's scale); both ``(*x.shape[:-1], N)``."""
    import qtransform as qt

    k, n = x.shape[-1], m.qweight.shape[0]
    qp = m.input_qparams(x)
    a = qt.unpacked_codes(qt.quantize(x.reshape(-1, k), qp)).double()
    sa, za = (None if t is None else t.double() for t in qp.effective())
    sw, zw = (None if t is None else t.double() for t in m.qweight.qparams.effective())
    b = qt.unpacked_codes(m.qweight).double()
    xa = (a if za is None else a - za) * sa
    wb = (b if zw is None else b - zw) * sw
    shape = (*x.shape[:-1], n)
    return (xa @ wb.t()).reshape(shape), (xa.abs() @ wb.abs().t()).reshape(shape)


def same_model_bound(original, preset: str, ids: torch.Tensor, before: torch.Tensor) -> float:
    """The largest change of the logits ``before`` a preset may make to ``original`` and still give "the same model":
    half their range; for 2-bit presets (one 2-bit group per row of these 64-wide random models, where no method keeps
    that) what round to nearest with the preset's own spec changes, with a quarter more."""
    import dataclasses

    import bridge
    import qtransform as qt

    p = qt.get_preset(preset)
    if p.spec is None or p.spec.fmt.bits > 2:
        return 0.5 * float(before.abs().max())
    rtn = bridge.quantize(original, dataclasses.replace(p.recipe, steps=()), kernel="dequant")
    with torch.no_grad():
        return 1.25 * float((rtn(input_ids=ids).logits - before).abs().max())


def hidden_into(model, name: str, batches) -> list:
    """What enters block ``name`` of ``model`` on each batch of token ids, by a hook on the model itself (the reference
    the block-by-block runner's inputs are checked against)."""
    got = []
    handle = model.get_submodule(name).register_forward_pre_hook(
        lambda m, args, kwargs: got.append((args[0] if args else kwargs["hidden_states"]).detach().clone()),
        with_kwargs=True)
    with torch.no_grad():
        for b in batches:
            model(b, use_cache=False)
    handle.remove()
    return got


def tiny_block_model(arch: str):
    """A tiny untrained model (seed 0) for the block-by-block learning steps: a causal LM of ``arch``, or a
    mixture-of-experts one (``qwen3_moe``, ``mixtral``: ``tests/bridge/moe/tiny_moe.py``)."""
    torch.manual_seed(0)
    if arch in ("qwen3_moe", "mixtral"):
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent / "moe"))
        from tiny_moe import build_tiny_moe

        return build_tiny_moe(arch)
    return tiny_causal_lm(arch).eval()


def token_batches(n: int, seed: int, vocab: int = 128, shape=(2, 24)) -> list:
    """``n`` batches of random token ids (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(n)]
