"""peft LoRA on :class:`~bridge.QLinear` (QLoRA through qtransform's quantized modules).

Importing :mod:`bridge` imports this module when peft is installed (peft is an optional extra; without
it nothing here is imported), and :func:`patch_peft` teaches peft's LoRA dispatch the ``QLinear`` type, so
``get_peft_model(AutoModelForCausalLM.from_pretrained(quantized_dir), LoraConfig(target_modules=[...]))``
wraps each targeted ``QLinear`` in a :class:`QLoraLinear` with no registration by the user:

>>> import torch, qtransform as qt, bridge
>>> from peft import LoraConfig, get_peft_model
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
>>> model = bridge.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()), spec)
>>> lora = get_peft_model(model, LoraConfig(target_modules=["0"], r=4))
>>> lora.base_model.model[0].lora_A["default"]
Linear(in_features=64, out_features=4, bias=False)
>>> lora(torch.randn(2, 64)).shape
torch.Size([2, 32])

How: peft has no public registry of LoRA layer types for third-party quantized layers (``LoraConfig._register_custom_module``
is per config object, so a config read back by ``PeftModel.from_pretrained`` would lack it); this module
wraps ``LoraModel._create_new_module``, the function that runs peft's dispatchers (``dispatch_hqq``,
``dispatch_torchao``..., ``dispatch_default``), so a ``QLinear`` reaches :func:`dispatch_qlinear` first and
every other module reaches peft's own list unchanged. A user's ``_register_custom_module`` mapping for
``QLinear`` still wins. Tested with peft 0.21.

The base weight stays quantized and frozen (its codes and scales are buffers, never trained); the
forward is ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` and gradients reach ``x`` through the base
module. Plain LoRA only: DoRA and the other variants, ``lora_bias`` and initialisations that read or
rewrite the base weight (PiSSA, OLoRA, LoftQ...) are refused with a ``ValueError`` naming the option.

Merging (``merge``, ``merge_and_unload``) keeps the layer quantized: the weight is dequantized, the LoRA
deltas ``B @ A * scaling`` are added in float32 and the sum is re-quantized by round-to-nearest with the
layer's own spec (``qt.choose_qparams`` with its default min-max range, then ``qt.quantize``), so the
merged model has the same spec, shapes and checkpoint format, and its outputs equal the unmerged ones to
within that re-quantization error, not exactly; a weight fitted by GPTQ/AWQ/HQQ is rounded again from
scratch (its fit is lost). The packed buffers are never written in place: ``unmerge`` restores the weight
held before the first merge, bit for bit.
"""

from __future__ import annotations

import warnings

import peft
import torch
from peft.tuners.lora import model as _lora_model
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn

import qtransform as qt

from ..modules import QLinear

__all__ = ["QLoraLinear", "dispatch_qlinear", "patch_peft", "PEFT_TESTED"]

#: The peft version this integration is tested with (older ones may lack the LoRA layer API it uses).
PEFT_TESTED = "0.21"
_PLAIN_INITS = (True, False, "gaussian")


def _moved(q: qt.QTensor, device: torch.device) -> qt.QTensor:
    """``q`` with its tensors on ``device`` (``q`` itself when already there)."""
    if q.device == device:
        return q
    qp = q.qparams
    params = qt.QParams(spec=qp.spec, **{k: v.to(device) for k, v in qp.tensors().items()})
    return qt.QTensor(codes=q.codes.to(device), qparams=params, width=q.width, dtype=q.dtype)


class QLoraLinear(nn.Module, LoraLayer):
    """LoRA adapters on a :class:`~bridge.QLinear` (see the module docstring).

    Args:
        base_layer: the ``QLinear`` (or a peft layer wrapping one).
        adapter_name: the adapter's name.
        config: the ``LoraConfig``.
        r: the rank.
        lora_alpha: the scaling numerator (``scaling = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
        **kwargs: what peft's dispatch passes on (``target_name``, ``tied_adapter``...).

    Shapes: ``x (..., in_features) -> (..., out_features)``; ``lora_A.weight`` is ``(r, in_features)`` and
    ``lora_B.weight`` ``(out_features, r)``, as for peft's ``nn.Linear`` LoRA, whatever the stored layout of
    the base weight (a ``Conv1D``'s ``(in, out)`` included).
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1,
                 **kwargs) -> None:
        init = config.init_lora_weights
        if init not in _PLAIN_INITS:
            raise ValueError(f"LoraConfig.init_lora_weights={init!r}: a quantized QLinear supports plain LoRA "
                             f"initialisations only ({', '.join(map(repr, _PLAIN_INITS))})")
        if config.lora_bias:
            raise ValueError("LoraConfig.lora_bias=True: not supported on a quantized QLinear")
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        self.fan_in_fan_out = False  # lora_B @ lora_A is (out, in); merge transposes for a stored (in, out)
        self._active_adapter = adapter_name
        self._premerge: qt.QTensor | None = None  # the base weight before the first merge
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def resolve_lora_variant(self, *, config, **kwargs):
        try:
            variant = super().resolve_lora_variant(config=config, **kwargs)
        except ValueError as e:
            raise ValueError(f"LoraConfig: a quantized QLinear supports plain LoRA only, not DoRA or other "
                             f"variants ({e})") from None
        if variant is not None:  # pragma: no cover - the plain mapping has no variant class
            raise ValueError("LoraConfig: a quantized QLinear supports plain LoRA only")
        return None

    # ------------------------------------------------------------------ weights
    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``lora_B @ lora_A * scaling`` of ``adapter``: ``(out_features, in_features)``, in the adapter's dtype
        (computed in float32)."""
        a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        return ((b.float() @ a.float()) * self.scaling[adapter]).to(b.dtype)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Merge adapters into the base weight and re-quantize it with its own spec (round-to-nearest).

        Args:
            safe_merge: kept for peft's interface; the merged weight is always checked for non-finite
                values before anything changes (the packed buffers are replaced, never written in place).
            adapter_names: the adapters to merge (default: the active ones).

        Raises:
            ValueError: if the merged weight has non-finite values (nothing is changed then).
        """
        names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not names:
            return
        base = self.get_base_layer()
        q = base.qweight
        w = qt.dequantize(q, dtype=torch.float32)
        for a in names:
            delta = self.get_delta_weight(a).to(device=w.device, dtype=torch.float32)
            w = w + (delta.T if base.transposed else delta)
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"merge: adapter(s) {names} give non-finite values in the merged weight; "
                             "nothing was merged")
        w = w.to(q.dtype)
        merged = qt.quantize(w, qt.choose_qparams(w, base.spec))
        if not self.merged:
            self._premerge = q
        base.set_qweight(merged)
        self.merged_adapters.extend(names)

    def unmerge(self) -> None:
        """Restore the base weight held before the first merge (bit for bit) and mark all adapters unmerged."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        base = self.get_base_layer()
        base.set_qweight(_moved(self._premerge, base.weight.device))
        self._premerge = None
        self.merged_adapters.clear()

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        adapter_names = kwargs.pop("adapter_names", None)
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if adapter_names is not None:
            return self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            h = self._cast_input_dtype(x, lora_A.weight.dtype)
            result = result + lora_B(lora_A(self.lora_dropout[name](h))) * self.scaling[name]
        return result.to(dtype)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def dispatch_qlinear(target: nn.Module, adapter_name: str, config, parameter_name: str | None = None,
                     **kwargs) -> QLoraLinear | None:
    """peft dispatcher: a :class:`QLoraLinear` for a ``QLinear`` target, ``None`` for anything else (and for a
    ``QLinear`` the config maps to a custom LoRA class of the user's, or a targeted parameter)."""
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if not isinstance(base, QLinear) or parameter_name is not None:
        return None
    if any(isinstance(base, k) for k in (getattr(config, "_custom_modules", None) or {})):
        return None
    return QLoraLinear(target, adapter_name, config=config, **kwargs)


def patch_peft() -> bool:
    """Put :func:`dispatch_qlinear` ahead of peft's LoRA dispatchers (idempotent; done on ``import bridge``).

    Returns:
        ``True`` when installed (or already), ``False`` (with a warning) when this peft lacks the hook.
    """
    cls = getattr(_lora_model, "LoraModel", None)
    original = getattr(cls, "_create_new_module", None)
    if original is None:
        warnings.warn(f"bridge: peft {peft.__version__} has no LoraModel._create_new_module; LoRA on QLinear "
                      f"is not available (tested with peft {PEFT_TESTED})")
        return False
    if getattr(original, "_qtransform", False):
        return True

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        new = dispatch_qlinear(target, adapter_name, lora_config, **kwargs)
        return new if new is not None else original(lora_config, adapter_name, target, **kwargs)

    _create_new_module._qtransform = True
    _create_new_module.__wrapped__ = original
    _create_new_module.__doc__ = original.__doc__
    cls._create_new_module = staticmethod(_create_new_module)
    return True


patch_peft()
