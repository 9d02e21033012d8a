"""Forward paths of the quantized modules (see :mod:`.base`). Import order is priority order:
fp8 on GPU, the packed CPU kernels, then the reference paths."""

from .base import (CONV_KERNELS, EMBEDDING_KERNELS, LINEAR_KERNELS, Kernel, choose, eligible, register_kernel)
from . import fp8, cpu, reference
from .cpu import INT4_GROUPS, int4pack_linear, int8pack_linear
from .fp8 import fp8_linear

__all__ = ["Kernel", "LINEAR_KERNELS", "EMBEDDING_KERNELS", "CONV_KERNELS", "register_kernel", "choose", "eligible",
           "INT4_GROUPS", "int4pack_linear", "int8pack_linear", "fp8_linear", "fp8", "cpu", "reference"]
