"""``QMultiheadAttention``: ``nn.MultiheadAttention`` with quantized projections.

``nn.MultiheadAttention`` never calls its projections: ``F.multi_head_attention_forward`` reads the
in-projection (``in_proj_weight`` ``(3E, E)``, packed; or ``q_proj_weight`` ``(E, E)``, ``k_proj_weight``
``(E, kdim)``, ``v_proj_weight`` ``(E, vdim)`` when ``kdim``/``vdim`` differ from ``embed_dim``) and
``out_proj.weight`` as tensors, and so do the fused fast paths of ``nn.TransformerEncoderLayer`` and
``nn.TransformerEncoder``. A quantized module there would hand them integer codes. So the whole module is
replaced: ``QMultiheadAttention`` computes the attention of torch's functional path step for step, with

* the in-projection weights held as QTensors in buffers named by the native layout (``in_proj_weight``,
  ``in_proj_weight_scale``... : the float module's tree paths, so checkpoints and recipes name them as before),
  dequantized for the projection (torch's ``_in_projection_packed`` / ``_in_projection`` on them);
* ``out_proj`` *called* as a module: a ``QLinear`` (any kernel, its own activation quantizers) or the float
  ``nn.Linear`` where the recipe leaves it alone.

Invariant: ``module(query, key, value, ...)`` equals ``nn.MultiheadAttention`` holding the dequantized weights,
in every mode (``batch_first``, unbatched input, masks, ``need_weights``, ``average_attn_weights``, ``is_causal``,
``add_bias_kv``, ``add_zero_attn``, ``bias=False``, separate ``kdim``/``vdim`` weights), to float rounding (the
out-projection's kernel's rounding, see :mod:`bridge.kernels`).

Recipes: the in-projection weights are tensors of a ``MultiheadAttention`` (their module type), ``out_proj.weight``
one of a ``NonDynamicallyQuantizableLinear``. A ``MultiheadAttention`` type rule reaches all of its projection
weights (``out_proj.weight`` too, unless a ``NonDynamicallyQuantizableLinear`` rule is given); without one, a
``Linear`` rule does (every preset quantizes them); a glob rule (``"*.in_proj_weight"``) selects one as it does
any tensor. ``bias_k``/``bias_v`` are never weights of a projection: a type rule leaves them in float, a glob rule
selecting one is refused by name (:func:`bridge.plan`).

Activations: the ``input`` site of the module (``Site("<mha>", "input")``) quantizes what enters the
in-projection: query, key and value, each on its own (a dynamic spec fits each; static QParams, calibrated on
all three, must be per tensor: query, key and value may have different widths). ``out_proj``'s input is its own
site (``<mha>.out_proj``), a ``QLinear``'s. An ``output`` quantizer on the module itself is refused by name.
Replacing a module inside a ``TransformerEncoderLayer`` turns off the layer's fused path (and the encoder's
nested-tensor path): :func:`bridge.modules.mha_model.fused_paths_off`.

>>> import torch, qtransform as qt
>>> mha = torch.nn.MultiheadAttention(8, 2).eval()
>>> spec = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
>>> q = qt.quantize(mha.in_proj_weight.detach(), qt.choose_qparams(mha.in_proj_weight.detach(), spec))
>>> m = QMultiheadAttention(mha)
>>> m.set_qtensor("in_proj_weight", q)
>>> ref = torch.nn.MultiheadAttention(8, 2).eval()
>>> _ = ref.load_state_dict({**mha.state_dict(), "in_proj_weight": qt.dequantize(q)})
>>> x = torch.randn(5, 1, 8)
>>> torch.allclose(m(x, x, x)[0], ref(x, x, x)[0], atol=1e-6)
True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

import qtransform as qt
from qtransform import QTensor

from ..checkpoint.layout import NATIVE
from . import actquant
from .base import apply_moving_codes, register_quantized_class, weight_repr, store_codes
from .linear import QLinear

__all__ = ["QMultiheadAttention", "is_mha", "in_proj_names", "MHA_TYPE", "OUT_TYPE"]

MHA_TYPE, OUT_TYPE = "MultiheadAttention", "NonDynamicallyQuantizableLinear"
_HYPER = ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout", "batch_first", "head_dim",
          "add_zero_attn")


def is_mha(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.MultiheadAttention`` (or its :class:`QMultiheadAttention`)."""
    return isinstance(module, (nn.MultiheadAttention, QMultiheadAttention))


def in_proj_names(module: nn.Module) -> tuple[str, ...]:
    """The in-projection weights of a multi-head attention module: ``("in_proj_weight",)`` packed, else
    ``("q_proj_weight", "k_proj_weight", "v_proj_weight")``."""
    return ("in_proj_weight",) if module._qkv_same_embed_dim else ("q_proj_weight", "k_proj_weight", "v_proj_weight")


class QMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with quantized in-projection weights and an ``out_proj`` it calls (see the
    module docstring). Built from the float module (parameters and ``out_proj`` shared, not copied); weights left
    in float stay ``nn.Parameter``s."""

    token_activations = True  # activation specs apply to the (tokens, features) matrix (see actquant)

    def __init__(self, module: nn.Module):
        super().__init__()
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"QMultiheadAttention: expected an nn.MultiheadAttention, got {type(module).__name__}")
        for k in _HYPER:
            setattr(self, k, getattr(module, k))
        self.float_class = type(module).__name__
        for name, p in module._parameters.items():
            self._parameters[name] = p  # None entries too: the float module's names, as torch registers them
        self.out_proj = module.out_proj
        self.bias_k, self.bias_v = module.bias_k, module.bias_v
        self._qmeta: dict[str, tuple] = {}  # name -> (spec, width, dtype, stored names)
        self.input_spec = None
        self.train(module.training)

    # ------------------------------------------------------------------ quantized weights
    @property
    def quantized_names(self) -> tuple[str, ...]:
        return tuple(self._qmeta)

    def _shape(self, name: str) -> tuple[int, ...]:
        if name in self._qmeta:
            return tuple(self.qtensor(name).shape)
        return tuple(self._parameters[name].shape)

    def set_qtensor(self, name: str, q: QTensor) -> None:
        """Hold in-projection weight ``name`` quantized as ``q`` (its shape must be the weight's)."""
        if name not in in_proj_names(self):
            raise ValueError(f"QMultiheadAttention: {name!r} is not one of its in-projection weights "
                             f"{list(in_proj_names(self))}")
        if not isinstance(q, QTensor):
            raise TypeError(f"QMultiheadAttention.{name}: expected a QTensor, got {type(q).__name__}")
        if tuple(q.shape) != self._shape(name):
            raise ValueError(f"QMultiheadAttention.{name}: quantized weight has shape {tuple(q.shape)}, the module "
                             f"needs {self._shape(name)}")
        store_codes(self, name, q)

    def qtensor(self, name: str) -> QTensor:
        """In-projection weight ``name`` as a QTensor over this module's buffers (no copy)."""
        if name not in self._qmeta:
            raise ValueError(f"QMultiheadAttention: {name!r} is not quantized (quantized: {list(self._qmeta)})")
        spec, width, dtype, _ = self._qmeta[name]
        return NATIVE.assemble(name, self._buffers, spec=spec, width=width, dtype=dtype)

    def projection_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """In-projection weight ``name`` as a float tensor (dequantized to ``dtype`` where quantized; a float one
        as it is)."""
        if name in self._qmeta:
            return qt.dequantize(self.qtensor(name), dtype=dtype)
        return self._parameters[name]

    def prepare(self) -> "QMultiheadAttention":
        """Nothing to pack ahead (the in-projection dequantizes; ``out_proj`` prepares itself)."""
        return self

    # ------------------------------------------------------------------ activation quantizers
    def set_activation(self, role: str, quant) -> None:
        """Quantize what enters the in-projection (``role="input"``): ``None``, a dynamic QuantSpec, or static
        per-tensor QParams (see the module docstring)."""
        if role != "input":
            raise ValueError(f"QMultiheadAttention: only an input quantizer (of query, key and value, before the "
                             f"in-projection) is supported, got role {role!r}; out_proj's quantizers are its own")
        if isinstance(quant, qt.QParams) and not isinstance(quant.spec.granularity, qt.PerTensor):
            raise ValueError(f"QMultiheadAttention: static input QParams must be per tensor (query, key and value "
                             f"share them), got {quant.spec.granularity}")
        actquant.attach(self, role, quant)

    def input_qparams(self, x: torch.Tensor):
        """The QParams that quantize the in-projection input ``x`` (fitted to it when dynamic), or ``None``."""
        return actquant.qparams_for(self, "input", x)

    # ------------------------------------------------------------------ forward
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``nn.MultiheadAttention.forward`` (its slow path: there is no fused one for quantized weights)."""
        is_batched = query.dim() == 3
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if self.batch_first and is_batched:  # the transposes keep the "is" relations, as torch's
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        out, weights = self._attend(query, key, value, key_padding_mask, need_weights, attn_mask,
                                    average_attn_weights, is_causal)
        return (out.transpose(1, 0) if self.batch_first and is_batched else out), weights

    def _in_project(self, query, key, value):
        """q, k, v: the in-projection of the (quantized) inputs, as torch's ``_in_projection(_packed)``."""
        quant = {}

        def q_of(t):  # each distinct tensor quantized once: the packed path's "is" relations hold
            if id(t) not in quant:
                quant[id(t)] = actquant.apply(self, "input", t)
            return quant[id(t)]

        query, key, value = q_of(query), q_of(key), q_of(value)
        b, dtype = self.in_proj_bias, query.dtype
        if self._qkv_same_embed_dim:
            return F._in_projection_packed(query, key, value, self.projection_weight("in_proj_weight", dtype), b)
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        w = [self.projection_weight(n, dtype) for n in in_proj_names(self)]
        return F._in_projection(query, key, value, *w, bq, bk, bv)

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                is_causal):
        """``F.multi_head_attention_forward`` after the module's own mask handling, with this module's
        projections."""
        heads, hd = self.num_heads, self.head_dim
        is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, heads)
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape
        src_len = key.shape[0]
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                               "method `generate_square_subsequent_mask` to create this mask.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None
        else:
            attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                          target_type=query.dtype, check_other=False)
            if key_padding_mask is not None:
                is_causal = False
        if embed_dim != self.embed_dim:
            raise ValueError(f"QMultiheadAttention: query has {embed_dim} features, embed_dim is {self.embed_dim}")
        q, k, v = self._in_project(query, key, value)
        if attn_mask is not None:
            want = (tgt_len, src_len) if attn_mask.dim() == 2 else (bsz * heads, tgt_len, src_len)
            if attn_mask.dim() not in (2, 3) or tuple(attn_mask.shape) != want:
                raise RuntimeError(f"The shape of the {attn_mask.dim()}D attn_mask is {tuple(attn_mask.shape)}, but "
                                   f"should be {want}.")
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.dim() == 2 else attn_mask
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        q = q.view(tgt_len, bsz * heads, hd).transpose(0, 1)
        k = k.view(k.shape[0], bsz * heads, hd).transpose(0, 1)
        v = v.view(v.shape[0], bsz * heads, hd).transpose(0, 1)
        if self.add_zero_attn:
            zeros = torch.zeros((bsz * heads, 1, hd), dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros.to(v.dtype)], dim=1)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        src_len = k.size(1)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (bsz, src_len):
                raise RuntimeError(f"expecting key_padding_mask shape of {(bsz, src_len)}, but got "
                                   f"{tuple(key_padding_mask.shape)}")
            key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1)
                                .reshape(bsz * heads, 1, src_len))
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
            if attn_mask is not None:
                weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
            else:
                weights = torch.bmm(q_scaled, k.transpose(-2, -1))
            weights = F.softmax(weights, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
            out = self.out_proj(out)
            out = out.view(tgt_len, bsz, out.size(1))
            weights = weights.view(bsz, heads, tgt_len, src_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            return (out, weights) if is_batched else (out.squeeze(1), weights.squeeze(0))
        if attn_mask is not None:
            attn_mask = (attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 and attn_mask.dim() == 3
                         else attn_mask.view(bsz, heads, -1, src_len))
        q, k, v = (t.view(bsz, heads, -1, hd) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim))
        out = out.view(tgt_len, bsz, out.size(1))
        return (out if is_batched else out.squeeze(1)), None

    # ------------------------------------------------------------------ torch.nn plumbing
    def _apply(self, fn, recurse=True):
        apply_moving_codes(self, fn, recurse, [n for meta in self._qmeta.values() for n in meta[3]])
        return self

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}", f"batch_first={self.batch_first}"]
        for name in in_proj_names(self):
            quantized = name in self._qmeta
            parts.append(weight_repr(name, self.qtensor(name) if quantized else None,
                                     None if quantized else self._parameters[name]))
        if self.input_spec is not None:
            parts.append(f"input={self.input_spec}")
        return ", ".join(parts)


# the out-projection is an nn.Linear subclass with Linear's forward: a QLinear replaces it exactly, once its
# attention module calls it (QMultiheadAttention: bridge.tree.rebuild swaps the module first)
register_quantized_class(OUT_TYPE, lambda m: type(m) is NonDynamicallyQuantizableLinear, QLinear)

