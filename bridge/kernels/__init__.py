"""Forward paths of the quantized modules (see :mod:`.base`). Import order is priority order: fp8
W8A8 (CUDA), int8 W8A8 (CUDA, then the opt-in CPU one, then the CPU one for dynamic per-token inputs), int4 weight-only on CUDA, the packed CPU
kernels, then the reference paths (the CUDA and CPU kernels never both apply to one module)."""

from .base import (CONV_KERNELS, EMBEDDING_KERNELS, LINEAR_KERNELS, Kernel, choose, eligible, register_kernel)
from . import fp8, int8mm, int8dyn, cuda, int4, cpu, reference
from .cpu import INT4_GROUPS, int4pack_linear, int8pack_linear
from .fp8 import fp8_linear
from .int8mm import int8_int_mm_linear
from .cuda import int4pack_cuda_linear

__all__ = ["Kernel", "LINEAR_KERNELS", "EMBEDDING_KERNELS", "CONV_KERNELS", "register_kernel", "choose", "eligible",
           "INT4_GROUPS", "int4pack_linear", "int8pack_linear", "fp8_linear", "int8_int_mm_linear", "int4pack_cuda_linear",
           "fp8", "int8mm", "int8dyn", "cuda", "int4", "cpu", "reference"]
