"""On paper: GPTQ's time on a larger model and N ranks, from the parts measured on SmolLM2 (bench_distributed.py).

Each part is scaled by its cost model, with one rate (seconds per unit) measured on this CPU, one thread per rank:

* forward passes (calibration passes, block outputs, the first block's inputs): ``tokens × params of a layer``,
  split over the ranks (data-parallel);
* Hessian accumulation: ``tokens × d_in²`` of each shared input, split over the ranks;
* solves: ``d_in³ + d_out·d_in²`` of each shared solve (the library's ``gptq.solve_cost``), its group init (the
  clipping search) ``d_out·d_in``; each block's solves go to their owners by the library's LPT on
  ``solve_cost``, and a block takes as long as its busiest rank;
* communication: ``bytes`` of the Hessians (float64) plus the packed results, ``× ceil(log2 N)`` (a tree
  reduce and broadcast), none on one rank.

    T(N) = (F·tokens·P + H·tokens·ΣD²)·L / N + L · max_r Σ_{solves owned by r} (S·cost + I·d_out·d_in)
           + C · bytes · L · ceil(log2 N)

>>> sets = model_sets(SMOLLM2)
>>> [s["name"] for s in sets], [s["d_in"] for s in sets]
(['q_proj+k_proj+v_proj', 'o_proj', 'gate_proj+up_proj', 'down_proj'], [576, 576, 576, 1536])
>>> lpt_owners([s["cost"] for s in model_sets(LLAMA3_8B)], 2)
[1, 1, 1, 0]
"""

from __future__ import annotations

import math

#: hidden size, MLP size, attention heads, key/value heads, layers.
SMOLLM2 = {"name": "SmolLM2-135M", "hidden": 576, "inter": 1536, "heads": 9, "kv_heads": 3, "layers": 30}
LLAMA3_8B = {"name": "Llama-3-8B", "hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "layers": 32}
#: llm-compressor's published GPTQ W4A16 on Meta-Llama-3-8B-Instruct, torchrun DDP on GPUs (ranks -> seconds).
LLMC_TABLE = {1: 745, 2: 372, 4: 264}


def model_sets(cfg: dict) -> list[dict]:
    """One layer's shared solves of a Llama-like model: name, d_in, d_out (summed over the sharing linears),
    the library's cost ``d_in³ + d_out·d_in²`` and the weights' elements."""
    h, i = cfg["hidden"], cfg["inter"]
    kv = h // cfg["heads"] * cfg["kv_heads"]
    out = []
    for name, d_in, d_out in (("q_proj+k_proj+v_proj", h, h + 2 * kv), ("o_proj", h, h),
                              ("gate_proj+up_proj", h, 2 * i), ("down_proj", i, h)):
        out.append({"name": name, "d_in": d_in, "d_out": d_out, "cost": float(d_in) ** 3 + float(d_out) * d_in ** 2,
                    "params": d_in * d_out})
    return out


def lpt_owners(costs: list[float], world: int) -> list[int]:
    """The owners :func:`qtransform.parallel.lpt` gives (longest first, each to the least loaded rank)."""
    load, owner = [0.0] * world, [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(world), key=lambda j: (load[j], j))
        owner[k] = r
        load[r] += costs[k]
    return owner


def units(cfg: dict, tokens: int) -> dict:
    """The work units of the cost models for the whole model."""
    sets = model_sets(cfg)
    layer_params = sum(s["params"] for s in sets)
    return {"forward": tokens * layer_params * cfg["layers"],
            "hessian": tokens * sum(s["d_in"] ** 2 for s in sets) * cfg["layers"],
            "solve": sum(s["cost"] for s in sets) * cfg["layers"],
            "init": layer_params * cfg["layers"],
            "bytes": (sum(8 * s["d_in"] ** 2 for s in sets) + layer_params // 2) * cfg["layers"]}


def rates(parts: dict, cfg: dict, tokens: int) -> dict:
    """Seconds per unit from measured seconds (``parts``: forward, hessian, solve, init summed over the ranks;
    comm as the slowest rank's, on 2 ranks)."""
    u = units(cfg, tokens)
    return {k: parts[k] / u[k] for k in ("forward", "hessian", "solve", "init")} | {"comm": parts["comm"] / u["bytes"]}


def project(rate: dict, cfg: dict, tokens: int, world: int) -> dict:
    """The parts of ``T(world)`` (see the module docstring) and their total, in seconds."""
    u, sets = units(cfg, tokens), model_sets(cfg)
    owners = lpt_owners([s["cost"] for s in sets], world)
    load = [0.0] * world
    for s, r in zip(sets, owners):
        load[r] += rate["solve"] * s["cost"] + rate["init"] * s["params"]
    out = {"forward": rate["forward"] * u["forward"] / world, "hessian": rate["hessian"] * u["hessian"] / world,
           "solves": max(load) * cfg["layers"],
           "comm": rate["comm"] * u["bytes"] * math.ceil(math.log2(world)) if world > 1 else 0.0}
    out["total"] = sum(out.values())
    out["solve_share"] = max(load) / sum(load) if sum(load) else 0.0  # the busiest rank's share of a block's solves
    return out
