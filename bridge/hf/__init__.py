"""transformers integration (a leaf: nothing else in the bridge imports it). Importing it registers
``quant_method: "qtransform"`` with transformers."""

from .config import QTransformConfig
from .quantizer import QTransformHfQuantizer, attach_config, register

__all__ = ["QTransformConfig", "QTransformHfQuantizer", "attach_config", "register"]
