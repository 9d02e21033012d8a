"""Forward paths of the quantized modules (see :mod:`.base`). Import order is priority order:
fp8 on GPU, int8 W8A8 on CPU, the packed CPU kernels, then the reference paths."""

from .base import (CONV_KERNELS, EMBEDDING_KERNELS, LINEAR_KERNELS, Kernel, choose, eligible, register_kernel)
from . import fp8, int8mm, cpu, reference
from .cpu import INT4_GROUPS, int4pack_linear, int8pack_linear
from .fp8 import fp8_linear
from .int8mm import int8_int_mm_linear

__all__ = ["Kernel", "LINEAR_KERNELS", "EMBEDDING_KERNELS", "CONV_KERNELS", "register_kernel", "choose", "eligible",
           "INT4_GROUPS", "int4pack_linear", "int8pack_linear", "fp8_linear", "int8_int_mm_linear",
           "fp8", "int8mm", "cpu", "reference"]
