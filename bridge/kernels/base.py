"""Forward paths of the quantized modules, chosen per module and device: the tables and the choice.

====================  ==========================================================  ================
kernel                when                                                        modules
====================  ==========================================================  ================
``fp8_scaled_mm``     CUDA with compute capability >= 8.9, float8_e4m3fn weights  QLinear
                      with per-tensor/per-channel scales *and* a symmetric
                      float8_e4m3fn input quantizer, per tensor or per token
                      (real W8A8 fp8), K and N multiples of 16:
                      ``torch._scaled_mm``
``int8_int_mm_cuda``  CUDA with compute capability >= 8.0, 8-bit integer weight   QLinear
                      codes with symmetric per-channel/per-tensor scales *and* an
                      8-bit integer input quantizer (as ``int8_int_mm_cpu``), K
                      and N multiples of 8 (real W8A8 int8): ``torch._int_mm``,
                      fewer than 17 token rows padded up
``int8_int_mm_cpu``   CPU, 8-bit integer weight codes with symmetric per-channel/ QLinear
                      per-tensor scales *and* an 8-bit integer input quantizer
                      (dynamic per-token or per-tensor, static per-tensor; an
                      integer zero point allowed), ``in_features <= 65535``
                      (real W8A8 int8): ``torch._int_mm``. Opt-in: ``auto``
                      never chooses it (see below)
``int8_dynamic_cpu``  CPU with the AVX2 build, int8 weight codes with symmetric   QLinear
                      per-channel/per-tensor scales *and* a dynamic per-token
                      int8 input quantizer (round half to even, float32 scales;
                      symmetric or an integer zero point): the fused quantizer
                      and an int8 GEMV below ``int8dyn.MAX_ROWS`` tokens,
                      fake-quantize + ``F.linear`` above (:mod:`.int8dyn`)
``int4pack_cuda``     CUDA with compute capability >= 8.0, integer codes of at    QLinear
                      most 4 bits, per-group (a group that 32..256 divides, as
                      ``int4pack_cpu``) or per-channel scales, ``out_features %
                      8 == 0``, ``in_features % 32 == 0``: the tinygemm kernel
                      ``aten._weight_int4pack_mm`` (bf16)
``int4pack_cpu``      CPU, integer codes of at most 4 bits, per-group scales      QLinear
                      (a group that 32/64/128/256 divides, along in_features; a
                      padded last group too) or per-channel, ``out_features %
                      16 == 0``: ``aten._weight_int4pack_mm_for_cpu``
``int8pack_cpu``      CPU, 8-bit integer codes, per-channel symmetric scales:     QLinear
                      ``aten._weight_int8pack_mm``
``gather``            embedding rows: dequantize only the rows looked up          QEmbedding(Bag)
``dequant``           everything: dequantize this one layer's weight, then the    all
                      float op (the reference; on any device, CUDA included)
====================  ==========================================================  ================

Each kernel checks the device of the module's buffers, so ``model.to("cuda")`` (or a checkpoint
loaded with ``device_map="cuda"``) chooses the CUDA kernels and ``.to("cpu")`` the CPU ones again:
moving a module drops its prepared state, derived again on the new device at the next call.

With many tokens (``dense.PREFILL_ROWS``, measured) ``int4pack_cpu`` and ``int8pack_cpu``
dequantize into a reused buffer and run ``F.linear`` in the input's dtype (:mod:`.dense`): the
packed kernels are compute-bound there. ``int4pack_cuda`` does the same from 256 tokens on
(``PREFILL_ROWS["int4pack_cuda"]``, the crossover measured on an H200 by ``bench/gpu_crossover.py``).
Every path has a backward with respect to its input
(through the dequantized weight, recomputed: the quantized weight is frozen), and the choice
and packing happen outside ``forward``'s traced path (``QModule.prepare``), so
``torch.compile(fullgraph=True)`` traces quantized models.

``module.kernel`` tells which path runs; ``kernel="dequant"`` (or any eligible name) forces
one. The packed int4/int8 kernels (CPU and CUDA) compute in bfloat16 (activations and scales are
cast to bf16, accumulation is fp32): their output matches ``F.linear(x, dequantize(q))`` to bf16
rounding. The fp8 and int8 W8A8 paths quantize activations as the module's input quantizer
says, so they match the fake-quantized reference (the int8 one to float rounding: its int32
accumulation is exact). Packed weights are derived on first use and cached per device (never
saved: their layout depends on the device).

Why ``auto`` never chooses ``int8_int_mm_cpu``: without int8 dot-product instructions (AVX2
without VNNI) ``torch._int_mm`` has no fast GEMM, and the weight-only ``int8pack_cpu`` beats it at
every token count (``bench/bench_w8a8.py``; figures in ``docs/performance.md``), so no token
threshold would help. CPUs with VNNI/AMX, where oneDNN has an int8 GEMM, may make it pay: run the
bench there before making it a default.

>>> import torch, qtransform as qt
>>> from bridge.modules import QLinear
>>> lin = torch.nn.Linear(256, 64)
>>> spec = qt.QuantSpec(format="int4", granularity=qt.PerGroup(128))
>>> m = QLinear.from_float(lin, qt.quantize(lin.weight.detach(), qt.choose_qparams(lin.weight.detach(), spec)))
>>> m.kernel, m.available_kernels()
('int4pack_cpu', ('int4pack_cpu', 'dequant'))
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

import qtransform as qt
from qtransform.formats import IntCodec

__all__ = ["Kernel", "LINEAR_KERNELS", "EMBEDDING_KERNELS", "CONV_KERNELS", "register_kernel", "eligible", "choose",
           "always", "grid", "int_codec", "rows", "linear_common", "has_op"]


class Kernel(NamedTuple):
    """A forward path: ``check(module, forced) -> reason or None``, ``prepare(module) -> state``,
    ``run(module, state, x, **kw) -> y`` (bias excluded). ``quantizes_input``: ``run`` consumes
    the module's input quantizer itself (a low-precision matmul), so it is not applied before."""

    name: str
    check: Callable
    prepare: Callable | None
    run: Callable
    quantizes_input: bool = False


def _check_kernel(name: str, k) -> None:
    if not isinstance(k, Kernel) or k.name != name:
        raise TypeError(f"register_kernel: expected a Kernel named {name!r}, got {k!r}")


#: Kernel tables, fastest first (registration order): the first eligible kernel runs.
LINEAR_KERNELS = qt.Registry("linear kernel", check=_check_kernel)
EMBEDDING_KERNELS = qt.Registry("embedding kernel", check=_check_kernel)
CONV_KERNELS = qt.Registry("conv kernel", check=_check_kernel)


def register_kernel(table: qt.Registry, kernel: Kernel) -> Kernel:
    """Add ``kernel`` to ``table`` (after the ones already there)."""
    return table.register(kernel.name, kernel)


def has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def grid(module):
    """Effective scale grid shape (shapes only; works on meta buffers)."""
    s, _ = module.qweight.qparams.effective()
    return tuple(s.shape)


def int_codec(module):
    codec = module.spec.fmt.codec
    return codec if isinstance(codec, IntCodec) else None


def rows(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k)


def linear_common(module) -> str | None:
    return "transposed (Conv1D) layout" if module.transposed else None


def always(module, forced):
    """Eligible everywhere (the reference paths)."""
    return None


def eligible(module, table: dict[str, Kernel]) -> tuple[str, ...]:
    """Names of the kernels of ``table`` that apply to ``module`` on its device, fastest first."""
    return tuple(name for name, k in table.items() if k.check(module, False) is None)


def choose(module, table: dict[str, Kernel], request: str) -> str:
    """Resolve ``request`` (``"auto"`` or a kernel name) for ``module``; ``ValueError`` if it cannot run."""
    if request == "auto":
        return eligible(module, table)[0]
    if request not in table:
        raise ValueError(f"kernel must be 'auto' or one of {list(table)}, got {request!r}")
    reason = table[request].check(module, True)
    if reason is not None:
        raise ValueError(f"kernel {request!r} cannot run this {type(module).__name__}: {reason}")
    return request
