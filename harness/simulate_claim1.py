"""Claim 1's simulated records: paper-scale Figure 6 panels, and the simulator checked against measured cells.

- :func:`paper_pp_records`: Llama3-8B, 4k+4k, PP=8 x TP=2 and PP=16 x TP=1, both phase switchings, over N.
- :func:`paper_cp_records`: Llama3-8B, CP=16, 16k prefix, 8k suffix, N=16, prefetch on and off.
- :func:`validate_records`: for every measured PP cell, a single-process profile of the same model and group
  on this machine drives :func:`harness.simulate.simulate_pipeline`; for every measured CP cell, the on-demand
  run's per-layer compute and per-gather costs drive :func:`harness.simulate.simulate_cp_phase_b` to predict
  the prefetch run; and every PP cell's timed step is replayed from its own stage operations' durations
  (``pp_timelines``) against its measured span (``pp_span_s``): the schedule model alone, free of the load
  drift between a profile and the run on a shared machine. Each row holds the measured and predicted seconds
  and the relative error.

Paper-scale costs are FLOPs at an assumed sustained throughput and assumed links (``ASSUMPTIONS``, stored in
every record); every such record has ``source == "simulated"``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pandas as pd

from harness import costmodel
from harness import simulate as sim

__all__ = [
    "ASSUMPTIONS",
    "LLAMA3_8B",
    "paper_pp_records",
    "paper_cp_records",
    "validate_records",
    "stage_layers",
]

LLAMA3_8B = costmodel.ModelShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
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
        out = sim.simulate_cp_phase_b(layers.forward[0], layers.backward[0], n_microbatches=N, gather_s=gather,
                                      scatter_s=scatter, prefetch=prefetch,
                                      other_comm_s=shape.n_layers * sequence)  # fmt: skip
        rows.append(_record("fig6a", system, pp=1, tp=1, cp=cp, world_size=cp, n=N, prefix_len=P, suffix_len=S,
                            microbatch=1, phase_b_s=out["phase_b_s"], cp_exposed_s=out["exposed_s"],
                            cp_overlapped_s=out["overlapped_s"], cp_sequence_phase_b_s=out["other_comm_s"],
                            cp_demand_gathers=out["demand_gathers"],
                            cp_prefetched_gathers=out["prefetched_gathers"]))  # fmt: skip
    return rows


# --- validation against measured cells ---------------------------------------------------------------------


def _profile_for(rec: pd.Series) -> tuple[sim.LayerCosts, Any]:
    """Single-process per-layer costs of a measured cell's model and group (the cell's config)."""
    import torch

    from harness.runner import DTYPES, make_group
    from harness.spec import Cell
    from prefixflow import apply_ac, apply_prefixflow, build_model, model_args

    cell = Cell.model_validate_json(rec["config"])
    model = build_model(
        cell.model.name, dtype=DTYPES[cell.dtype], seed=cell.seed, overrides=dict(cell.model.overrides)
    )
    apply_ac(model, cell.ac)
    apply_prefixflow(model)
    group = make_group(cell, int(model_args(model).vocab_size))
    with torch.random.fork_rng(devices=[]):
        costs = sim.profile_layers(
            model, group, system="prefixflow", layout=cell.layout, microbatch=cell.microbatch
        )
    return costs, model_args(model)


def _validation_row(rec: pd.Series, quantity: str, predicted: float, measured_s: float) -> dict:
    return {
        "cell_id": rec["cell_id"],
        "spec": "claim1-validation",
        "system": rec["system"],
        "status": "ok",
        "source": "simulator-validation",
        "device": "simulated",
        "pp": int(rec.get("pp", 1)),
        "cp": int(rec.get("cp", 1)),
        "n": int(rec["n"]),
        "quantity": quantity,
        "measured_s": measured_s,
        "predicted_s": predicted,
        "sim_error": sim.relative_error(predicted, measured_s),
    }


def _timeline_costs(rec: pd.Series, profiled: sim.PipelineCosts) -> sim.PipelineCosts | None:
    """The stage operations' own durations in the measured step (``pp_timelines``), with the profiled costs'
    messages and barrier: the schedule model checked on costs free of the load drift between a profile and
    the run."""
    raw, span = rec.get("pp_timelines"), rec.get("pp_span_s")
    if not isinstance(raw, str) or span is None or span != span:
        return None
    stages = json.loads(raw)
    n_mb = profiled.n_microbatches
    fwd = [[0.0] * n_mb for _ in stages]
    bwd = [[0.0] * n_mb for _ in stages]
    pre_f, pre_b = [0.0] * len(stages), [0.0] * len(stages)
    for s, events in enumerate(stages):
        for e in events:
            d = float(e["end"]) - float(e["start"])
            if e["op"] == "F":
                fwd[s][int(e["mb"])] = d
            elif e["op"] == "B":
                bwd[s][int(e["mb"])] = d
            elif e["op"] == "A":
                pre_f[s] = d
            elif e["op"] == "C":
                pre_b[s] = d
    return sim.PipelineCosts(forward=fwd, backward=bwd, prefix_forward=pre_f, prefix_backward=pre_b,
                             message=profiled.message, prefix_message=profiled.prefix_message,
                             barrier=profiled.barrier)  # fmt: skip


def validate_records(df: pd.DataFrame) -> list[dict]:
    """Per measured PP record: the step time from profiled costs and the span replayed from its own timeline;
    per measured CP prefetch record: Phase B."""
    m = df[
        (df["status"] == "ok")
        & df.get("source", pd.Series("measured", index=df.index)).fillna("measured").ne("simulated")
    ]
    if "quantity" in m.columns:  # alignment rows (Table 3) are not timings
        m = m[m["quantity"].isna()]
    rows: list[dict] = []
    pp = m[(m.get("pp", 1) > 1) & m["system"].isin(["prefixflow", "prefixflow_pp_barrier"])]
    for _, rec in pp.iterrows():
        layers, args = _profile_for(rec)
        a = ASSUMPTIONS
        mb_tokens = int(rec["suffix_len"]) * int(rec["microbatch"] or rec["n"])
        msg = _message_s(mb_tokens, args.dim, 1, a["loopback_bytes_per_s"], a["loopback_latency_s"], 4)
        prefix_msg = _message_s(int(rec["prefix_len"]) - 1, args.dim, 1, a["loopback_bytes_per_s"],
                                a["loopback_latency_s"], 4)  # fmt: skip
        costs = sim.pipeline_costs(layers, stage_layers(int(rec["pp"]), args.n_layers), message_s=msg,
                                   prefix_message_s=prefix_msg, barrier_s=a["loopback_latency_s"])  # fmt: skip
        switching = "barrier" if rec["system"] == "prefixflow_pp_barrier" else "stage_local"
        predicted = sim.simulate_pipeline(costs, switching).span_s
        rows.append(_validation_row(rec, "step_time_s", predicted, float(rec["step_time_s"])))
        timed = _timeline_costs(rec, costs)
        if timed is not None:
            predicted = sim.simulate_pipeline(timed, switching).span_s
            rows.append(_validation_row(rec, "pp_span_s", predicted, float(rec["pp_span_s"])))
    cp = m[(m.get("cp", 1) > 1) & (m.get("pp", 1) == 1)]
    for _, g in cp.groupby("cell_id"):
        demand = g[g["system"] == "prefixflow_cp_demand"]
        ahead = g[g["system"] == "prefixflow"]
        if demand.empty or ahead.empty:
            continue
        d, rec = demand.iloc[0], ahead.iloc[0]
        n_mb = -(-int(d["n"]) // int(d["microbatch"] or d["n"]))
        n_layers = int(d["n_layers"])
        compute = float(d["phase_b_s"]) - float(d["cp_exposed_s"]) - float(d["cp_sequence_phase_b_s"])
        per_layer = compute / (n_mb * n_layers)
        out = sim.simulate_cp_phase_b(
            [per_layer / 3] * n_layers,
            [2 * per_layer / 3] * n_layers,
            n_microbatches=n_mb,
            gather_s=float(d["cp_gather_wait_s"]) / max(float(d["cp_demand_gathers"]), 1),
            scatter_s=float(d["cp_scatter_s"]) / max(float(d["cp_scatters"]), 1),
            prefetch=True,
            other_comm_s=float(d["cp_sequence_phase_b_s"]) / n_mb,
        )
        rows.append(_validation_row(rec, "phase_b_s", out["phase_b_s"], float(rec["phase_b_s"])))
    return rows
