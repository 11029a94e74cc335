"""Claim 1's simulated records: the paper-scale Figure 6 panels.

- :func:`paper_pp_records`: Llama3-8B, 4k+4k, PP=8 x TP=2 and PP=16 x TP=1, both phase switchings, over N.
- :func:`paper_cp_records`: Llama3-8B, CP=16, 16k prefix, 8k suffix, N=16, prefetch on and off.

The simulator's check against the measured cells is ``harness/simulate/validate.py``.

Paper-scale costs are FLOPs at an assumed sustained throughput and assumed links (``ASSUMPTIONS``, stored in
every record); every such record has ``source == "simulated"``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from harness.costmodel.shape import ModelShape
from harness.simulate import pipeline as sim
from harness.simulate.cp import simulate_cp_phase_b

__all__ = [
    "ASSUMPTIONS",
    "LLAMA3_8B",
    "paper_pp_records",
    "paper_cp_records",
    "stage_layers",
]

LLAMA3_8B = ModelShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                                 hidden_dim=14336, vocab_size=128256)  # fmt: skip
ASSUMPTIONS = {
    "gpu": "H20 (paper setup)",
    "flops_per_s": 148e12 * 0.45,  # bf16 dense peak x an assumed 45% sustained
    "link_bytes_per_s": 25e9,  # one 200 Gb/s NIC per GPU (inter-node; the slower link sets ring steps)
    "link_latency_s": 20e-6,
    "bytes_per_element": 2,  # bf16 activations and K/V; gK/gV reduce-scattered in fp32 (4)
    "loopback_bytes_per_s": 1e9,  # measured-cell validation: gloo over loopback (CPU)
    "loopback_latency_s": 1e-4,
}


def _record(figure: str, system: str, **cols: Any) -> dict[str, Any]:
    ident = json.dumps({"figure": figure, "system": system, **cols}, sort_keys=True, default=str)
    return {
        "cell_id": hashlib.sha256(ident.encode()).hexdigest()[:12],
        "spec": "claim1-simulated",
        "system": system,
        "status": "ok",
        "source": "simulated",
        "figure": figure,
        "device": "simulated",
        "model": "llama3:8B",
        "dtype": "bf16",
        "layout": "padded",
        "dp": 1,
        "ep": 1,
        "sim_assumptions": json.dumps(ASSUMPTIONS, sort_keys=True),
        **cols,
    }


def stage_layers(
    n_stages: int, n_layers: int, input_weight: int = 1, output_weight: int = 1
) -> list[list[int]]:
    """Layer indices per stage, as TorchTitan's ``generate_llm_fqn_per_model_part`` splits them."""
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    names = generate_llm_fqn_per_model_part(n_stages, n_layers, input_weight, output_weight)
    return [[int(n.split(".")[1]) for n in stage if n.startswith("layers.")] for stage in names]


def _message_s(tokens: int, dim: int, tp: int, link: float, latency: float, nbytes: int) -> float:
    return latency + tokens * dim * nbytes / tp / link


def paper_pp_records(ns=(4, 8, 16, 32, 64), P: int = 4096, S: int = 4096) -> list[dict]:
    """Figure 6b's paper-scale panels: step time of both switchings per N (one suffix per microbatch)."""
    a = ASSUMPTIONS
    rows = []
    for pp, tp in ((8, 2), (16, 1)):
        stages = stage_layers(pp, LLAMA3_8B.n_layers)
        for n in ns:
            layers = sim.flop_layer_costs(
                LLAMA3_8B, P, S, n, microbatch=1, flops_per_s=a["flops_per_s"], tp=tp
            )
            msg = _message_s(
                S, LLAMA3_8B.dim, tp, a["link_bytes_per_s"], a["link_latency_s"], a["bytes_per_element"]
            )
            prefix_msg = _message_s(P - 1, LLAMA3_8B.dim, tp, a["link_bytes_per_s"], a["link_latency_s"], 2)
            costs = sim.pipeline_costs(layers, stages, message_s=msg, prefix_message_s=prefix_msg,
                                       barrier_s=a["link_latency_s"] * 2)  # fmt: skip
            for switching, system in (("stage_local", "prefixflow"), ("barrier", "prefixflow_pp_barrier")):
                res = sim.simulate_pipeline(costs, switching)
                rows.append(_record("fig6b", system, pp=pp, tp=tp, cp=1, world_size=pp * tp, n=n, prefix_len=P,
                                    suffix_len=S, microbatch=1, step_time_s=res.span_s,
                                    pp_bubble_max_s=max(res.bubbles)))  # fmt: skip
    return rows


def _ring_s(nbytes: float, ranks: int, link: float, latency: float) -> float:
    """A ring all-gather / reduce-scatter of a ``nbytes`` buffer over ``ranks`` ranks."""
    return (ranks - 1) * (latency + nbytes / ranks / link)


def paper_cp_records(cp: int = 16, P: int = 16384, S: int = 8192, N: int = 16) -> list[dict]:
    """Figure 6a's paper-scale panel: one rank's Phase B with prefix K/V gathers on demand and prefetched."""
    a = ASSUMPTIONS
    shape, link, lat = LLAMA3_8B, a["link_bytes_per_s"], a["link_latency_s"]
    layers = sim.flop_layer_costs(shape, P, S, N, microbatch=1, flops_per_s=a["flops_per_s"], cp=cp)
    kv = 2 * shape.n_kv_heads * shape.head_dim  # K and V elements per token
    gather = _ring_s((P - 1) * kv * a["bytes_per_element"], cp, link, lat)
    scatter = _ring_s((P - 1) * kv * 4, cp, link, lat)
    sequence = _ring_s(S * kv * a["bytes_per_element"], cp, link, lat) + _ring_s(S * kv * 4, cp, link, lat)
    rows = []
    for prefetch, system in ((False, "prefixflow_cp_demand"), (True, "prefixflow")):
        out = simulate_cp_phase_b(layers.forward[0], layers.backward[0], n_microbatches=N, gather_s=gather,
                                      scatter_s=scatter, prefetch=prefetch,
                                      other_comm_s=shape.n_layers * sequence)  # fmt: skip
        rows.append(_record("fig6a", system, pp=1, tp=1, cp=cp, world_size=cp, n=N, prefix_len=P, suffix_len=S,
                            microbatch=1, phase_b_s=out["phase_b_s"], cp_exposed_s=out["exposed_s"],
                            cp_overlapped_s=out["overlapped_s"], cp_sequence_phase_b_s=out["other_comm_s"],
                            cp_demand_gathers=out["demand_gathers"],
                            cp_prefetched_gathers=out["prefetched_gathers"]))  # fmt: skip
    return rows
