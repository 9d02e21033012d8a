"""A model's residual-stream layout for rotations (:class:`qtransform.rotation.ResidualLayout`), from
its family's row (:mod:`.families`: ``rotatable``, ``writers`` and the smoothing groups).

The smoothing groups already say which norm feeds which linears and which value projection feeds
which output projection; the layout adds the stream's other ends: the input embeddings, the writers
(the output projection and the MLP's down projection of every block) and the final norm with the
output head; and where online rotations may go: the down projections (their input, ``R4``) and the
attention modules with their head width (queries and keys, ``R3``). Only pre-norm RMSNorm families qualify
(rows with ``rotatable``: Llama, Mistral, Qwen2, Phi-3): a LayerNorm subtracts the mean, which no rotation of
the stream commutes with. Mixture-of-experts families (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE) rotate too: the norm before the MLP feeds the router, the experts' stacked
``gate_up_proj`` and the shared experts; the experts' stacked ``down_proj`` and the shared expert's down
projection write the stream. DeepSeek-V3's latent attention has no value -> output head pair (no ``R2``, so
no SpinQuant, which learns it); its latent norms read no stream and are left alone. Only the shared experts' and dense MLPs' down projections take an online ``R4``:
an experts module computes each expert's hidden activation inside its forward, where no hook reaches. GPT-OSS's
experts, stored ``(experts, in, out)``, are named in the layout's ``transposed`` (rotated on the other side).

>>> import transformers as tf
>>> m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=4, num_key_value_heads=2))
>>> lay = residual_layout(m)
>>> lay.embeddings, lay.writers, lay.norms[-1]
(('model.embed_tokens.weight',), ('model.layers.0.self_attn.o_proj.weight', 'model.layers.0.mlp.down_proj.weight'), NormReaders(weight='model.norm.weight', readers=('lm_head.weight',)))
"""

from __future__ import annotations

from torch import nn

from qtransform.rotation import HeadPair, NormReaders, QueryKey, ResidualLayout

from ..modules import kvcache
from ..modules.experts import expert_weights

from .embeddings import input_embeddings, output_embeddings
from .families import rotatable
from .groups import find_arch, smoothing_groups

__all__ = ["residual_layout", "model_layout"]


def residual_layout(model: nn.Module) -> ResidualLayout:
    """The :class:`~qtransform.rotation.ResidualLayout` of ``model`` (``ValueError`` naming the family
    for models whose stream cannot be rotated)."""
    arch = find_arch(model)
    if not arch.rotatable:
        raise ValueError(f"rotations: {type(model).__name__} ({arch.name}) normalises with LayerNorm, which "
                         f"subtracts the mean and does not commute with a rotation of the residual stream; "
                         f"rotatable families: {', '.join(rotatable())}")
    groups = smoothing_groups(model)
    norms, heads, writers, down = [], [], [], []
    modules = dict(model.named_modules())
    path = {id(m): n for n, m in modules.items()}
    for g in groups:
        prev = modules[g["prev"]]
        stacked = set(g.get("stacked", ()))
        if not hasattr(prev, "in_features") and not hasattr(prev, "nf"):  # a norm and the linears it feeds
            if g["prev"].rpartition(".")[0].rpartition(".")[0] != arch.blocks:
                continue  # a norm inside a sub-layer (DeepSeek's latent norms) reads no stream: not rotated
            norms.append(NormReaders(f"{g['prev']}.weight", tuple(l if l in stacked else f"{l}.weight"
                                                                  for l in g["linears"])))
        elif "head_dim" in g:
            rows = tuple(g["rows"]) if "rows" in g else None
            heads.append(HeadPair(f"{g['prev']}.weight", f"{g['linears'][0]}.weight", g["head_dim"], rows))
            writers.append(f"{g['linears'][0]}.weight")
        else:  # up -> down: the MLP's output writes the stream
            writers += [f"{l}.weight" for l in g["linears"]]
            down += [f"{l}.weight" for l in g["linears"]]
    for i in range(len(modules[arch.blocks])):
        writers += [f"{arch.blocks}.{i}.{w}.weight" for w in arch.writers]
    transposed = []
    for name, m in modules.items():  # the experts' outputs write the stream, each expert's (hidden, inter) rows
        names = expert_weights(m)
        if names:
            writers.append(f"{name}.{names[-1]}")
            if m.is_transposed:  # GPT-OSS: (experts, in, out)
                transposed += [f"{name}.{n}" for n in names]
    head = output_embeddings(model)
    final = modules.get(arch.blocks.rpartition(".")[0] + ".norm")
    if head is None or final is None:
        raise ValueError(f"rotations: {type(model).__name__} has no output head after a final "
                         f"{arch.blocks.rpartition('.')[0]}.norm (a causal LM of the {arch.name} family has both)")
    norms.append(NormReaders(f"{path[id(final)]}.weight", (f"{path[id(head)]}.weight",)))
    inputs = input_embeddings(model)
    if id(inputs) not in path:
        raise ValueError(f"rotations: {type(model).__name__} names no input embeddings (get_input_embeddings)")
    embeddings = (f"{path[id(inputs)]}.weight",)
    attention = tuple(QueryKey(p, modules[p].head_dim) for p in kvcache.attention_modules(model)
                      if isinstance(getattr(modules[p], "head_dim", None), int))
    return ResidualLayout(embeddings=embeddings, norms=tuple(norms), writers=tuple(writers), heads=tuple(heads),
                          down=tuple(down), attention=attention, transposed=tuple(transposed))


def model_layout(model: nn.Module) -> ResidualLayout | None:
    """``model``'s residual layout (:func:`residual_layout`), or ``None`` when its stream cannot be rotated or
    no architecture table fits it (``rotate`` and ``spinquant`` then refuse, naming the model)."""
    try:
        return residual_layout(model)
    except ValueError:
        return None
