"""Core throughput: observe + compute_qparams + quantize + pack, int4 per-group g128 asymmetric.

Side by side in one process, on fp32 weights of Llama-7B shapes:
  * vs torchao ``choose_qparams_affine`` + ``quantize_affine`` (uint4, integer zero point;
    torchao returns unpacked uint8 codes, we also pack two codes per byte);
  * vs hqq ``Quantizer.quantize(..., optimize=False, bitpack=True)`` (uint4, float zero point).
Reports GB/s of fp32 input, the speed ratio, and whether the codes agree bit for bit.

Run: ``make bench`` or ``python bench/bench_core.py``.
"""

from __future__ import annotations

import warnings

import torch

import qtransform as qt
from common import markdown, timeit, write

warnings.filterwarnings("ignore")
GROUP = 128
SHAPES = [(4096, 4096), (11008, 4096)]


def ours(w, spec):
    stats = qt.observe(qt.init_stats(spec), w)
    return qt.quantize(w, qt.compute_qparams(stats, spec))


def torchao_int(w):
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine
    s, z = choose_qparams_affine(w, MappingType.ASYMMETRIC, (1, GROUP), torch.uint8, 0, 15)
    return quantize_affine(w, (1, GROUP), s, z, torch.uint8, 0, 15)


def hqq_float(w):
    from hqq.core.quantize import Quantizer
    return Quantizer.quantize(w, nbits=4, group_size=GROUP, optimize=False, axis=1, bitpack=True,
                              compute_dtype=torch.float32, device="cpu")


def main():
    torch.manual_seed(0)
    int_spec = qt.QuantSpec(format="uint4", granularity=qt.PerGroup(GROUP), symmetric=False)
    float_spec = int_spec.replace(zero_point_domain="float")
    rows, table = [], []
    for shape in SHAPES:
        w = torch.randn(*shape)
        gb = w.numel() * 4 / 1e9
        t = timeit({"ours_int": lambda: ours(w, int_spec), "torchao": lambda: torchao_int(w),
                    "ours_float": lambda: ours(w, float_spec), "hqq": lambda: hqq_float(w)})
        # same scales and zero points; torchao multiplies by 1/scale where we divide, which moves
        # a handful of near-tie codes
        ao_agree = (qt.unpacked_codes(ours(w, int_spec)) == torchao_int(w)).float().mean().item()
        hq_codes, hq_meta = hqq_float(w)
        from hqq.core.bitpack import BitPack
        hq_unpacked = BitPack.unpack_4bit_u8(hq_codes, dtype=torch.uint8).reshape(-1, GROUP)
        ours_f = qt.unpacked_codes(ours(w, float_spec)).reshape(-1, GROUP)
        hq_agree = (hq_unpacked == ours_f).float().mean().item()
        for peer, mine, agree in (("torchao", "ours_int", ao_agree), ("hqq", "ours_float", hq_agree)):
            row = {"shape": list(shape), "peer": peer, "ours_s": t[mine], "peer_s": t[peer],
                   "ours_GBps": gb / t[mine], "peer_GBps": gb / t[peer], "speedup": t[peer] / t[mine],
                   "codes_agree": agree}
            rows.append(row)
            n_diff = round((1 - agree) * w.numel())
            agree_txt = "bit-exact" if n_diff == 0 else f"{n_diff} of {w.numel()} differ"
            table.append([f"{shape[0]}x{shape[1]}", peer, f"{1e3 * t[mine]:.1f} ms ({gb / t[mine]:.2f} GB/s)",
                          f"{1e3 * t[peer]:.1f} ms ({gb / t[peer]:.2f} GB/s)", f"{t[peer] / t[mine]:.2f}x",
                          agree_txt])
    write("core", rows, markdown(["weight", "peer", "qtransform", "peer time", "speedup", "codes"], table))


if __name__ == "__main__":
    main()
