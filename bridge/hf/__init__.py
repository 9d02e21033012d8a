"""transformers integration (a leaf: nothing else in the bridge imports it). Importing it registers
``quant_method: "qtransform"`` with transformers and, when the optional peft is installed, LoRA on
``QLinear`` with peft (:mod:`bridge.hf.peft`; peft is never imported when it is not installed)."""

from importlib.util import find_spec as _find_spec

from .config import QTransformConfig
from .quantizer import QTransformHfQuantizer, attach_config, register

if _find_spec("peft") is not None:
    from . import peft

__all__ = ["QTransformConfig", "QTransformHfQuantizer", "attach_config", "register"]
