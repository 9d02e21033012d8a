"""Helpers of bench/bench_gpu.py: random Llama models of real shapes built on the spot, calibration
tokens, device-synchronised timing, code comparison, kernel counts and the machine's description."""

from __future__ import annotations

import platform
import statistics
import time

import torch

from make_checkpoint import SHAPES as CHECKPOINT_SHAPES

#: Real shapes (randomly initialised: no files needed). ``llama3-8b-layer``: one Llama-3-8B decoder
#: layer with a small vocabulary, so that the layer, not the embedding or lm_head, is what is timed.
SHAPES = {
    "smollm2-135m": CHECKPOINT_SHAPES["smollm2-135m"],
    "tinyllama-1.1b": CHECKPOINT_SHAPES["tinyllama-1.1b"],
    "llama3-8b-layer": dict(CHECKPOINT_SHAPES["llama-3-8b"], num_hidden_layers=1, vocab_size=1024),
    # --small: seconds on a CPU, same code paths
    "tiny": dict(CHECKPOINT_SHAPES["tinyllama-1.1b"], hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "tiny-wide": dict(CHECKPOINT_SHAPES["tinyllama-1.1b"], hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=512),
}


def build_model(shape: str, device, *, dtype=torch.float32, seed: int = 0, layers: int | None = None):
    """A ``LlamaForCausalLM`` of ``shape`` on ``device``: weights ~ N(0, 0.02), norms 1, drawn from a
    generator on ``device`` seeded with ``seed`` (one pass, no default init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(SHAPES[shape])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    config = LlamaConfig(**kw, hidden_act="silu", attention_bias=False, mlp_bias=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device)
    model.model.rotary_emb = rotary(config, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for path, p in model.named_parameters():
            p.fill_(1.0) if path.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def rotary(config, device):
    """The rotary embedding's buffers, which ``to_empty`` left uninitialised, made on ``device``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device(device):
        return LlamaRotaryEmbedding(config).to(device)


def truncated_copy(model, blocks: int, device):
    """A copy of ``model``'s embeddings and first ``blocks`` decoder layers on ``device`` (the same
    weights: GPTQ sees the same inputs at those blocks as in the whole model)."""
    from transformers import LlamaForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = blocks
    with torch.device("meta"):
        small = LlamaForCausalLM(config)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < blocks}
    small.load_state_dict({k: v.detach().to(device, copy=True) for k, v in state.items()}, strict=False, assign=True)
    small.model.rotary_emb = rotary(config, device)
    if config.tie_word_embeddings:
        small.tie_weights()
    return small.to(next(model.parameters()).dtype).eval()


def calibration(vocab: int, n: int, seq: int, batch: int, *, seed: int = 1) -> list[torch.Tensor]:
    """``n`` sequences of ``seq`` random token ids (fixed seed), in batches of ``batch`` rows (CPU tensors:
    the pipeline moves each batch to the model's device)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=gen)
    return [ids[i:i + batch] for i in range(0, n, batch)]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    """``(result, seconds)`` of ``fn()``, the device synchronised before and after."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def median_time(fn, device, *, repeat: int, warmup: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls after ``warmup`` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device) -> float | None:
    if torch.device(device).type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return None


def compare_codes(a: dict, b: dict, prefixes: tuple[str, ...]) -> dict:
    """Fraction of equal codes between two quantized trees over the QTensors under ``prefixes``, and the
    largest code difference (1 at a near-tie; more means the paths disagree)."""
    import qtransform as qt

    equal = total = 0
    worst = 0
    paths = [p for p, v in a.items() if isinstance(v, qt.QTensor) and p.startswith(prefixes)]
    for p in paths:
        if not isinstance(b.get(p), qt.QTensor):
            raise ValueError(f"{p}: quantized on one device only")
        ca = qt.unpacked_codes(a[p]).cpu().to(torch.int32)
        cb = qt.unpacked_codes(b[p]).cpu().to(torch.int32)
        equal += int((ca == cb).sum())
        total += ca.numel()
        worst = max(worst, int((ca - cb).abs().max()) if ca.numel() else 0)
    return {"tensors": len(paths), "codes": total, "equal_fraction": equal / total if total else None,
            "max_code_diff": worst}


def available_kernels(model) -> str:
    import bridge

    q = next((m for m in model.modules() if isinstance(m, bridge.QLinear)), None)
    return ", ".join(q.available_kernels()) if q is not None else ""


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine(device) -> dict:
    import os

    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": cpu_name(), "cpu_count": os.cpu_count(), "cpu_threads": torch.get_num_threads(),
            "device": str(device), "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), capability=".".join(map(str, (p.major, p.minor))),
                    gpu_memory_gb=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def short_error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
