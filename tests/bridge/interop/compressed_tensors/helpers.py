"""Shared helpers of the compressed-tensors export/import tests: the recipes, calibration batches and tiny
models they quantize."""

import torch
from bridge_util import tiny_causal_lm

import qtransform as qt

FP8 = qt.QuantSpec(format="fp8_e4m3")
FP8_CHANNEL = qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0))


def recipe(name):
    """A preset's recipe, or ``fp8-dynamic`` (fp8 weights per channel, fp8 inputs per token at run time) or
    ``fp8-static-kv`` (fp8 weights, static per-tensor fp8 inputs and key/value cache)."""
    if name == "fp8-dynamic":
        return qt.Recipe(type_rules={"Linear": FP8_CHANNEL}, exclude=["lm_head*"],
                         input=qt.QuantSpec(format="fp8_e4m3", granularity=qt.PerChannel(0), dynamic=True))
    if name == "fp8-static-kv":
        return qt.Recipe(type_rules={"Linear": FP8_CHANNEL}, exclude=["lm_head*"], input=FP8, kv_cache=FP8)
    return qt.get_preset(name).recipe


def batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (2, 12), generator=g) for _ in range(n)]


def needs_calibration(r) -> bool:
    return (r.input is not None and not r.input.dynamic) or r.kv_cache is not None


def tiny(arch):
    """A tiny ``arch`` model as transformers saves it (its config names its class)."""
    torch.manual_seed(0)
    model = tiny_causal_lm(arch).eval()
    model.config.architectures = [type(model).__name__]
    return model
