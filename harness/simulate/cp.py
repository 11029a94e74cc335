"""Discrete-event model of one CP rank's Phase B: prefix K/V gathers on demand or prefetched (paper §4.5)."""

from __future__ import annotations

__all__ = ["simulate_cp_phase_b"]


def simulate_cp_phase_b(
    layer_forward: list[float],
    layer_backward: list[float],
    *,
    n_microbatches: int,
    gather_s: float,
    scatter_s: float,
    prefetch: bool,
    other_comm_s: float = 0.0,
    overlap_fraction: float = 1.0,
) -> dict[str, float]:
    """One rank's Phase B under CP: compute, exposed and overlapped prefix-K/V communication, gather counts.

    ``layer_forward``/``layer_backward``: compute seconds of each layer for one suffix microbatch;
    ``gather_s``/``scatter_s``: one prefix-K/V all-gather / gK-gV reduce-scatter; ``other_comm_s``: blocking
    communication per microbatch that prefetch does not touch (the sequence K/V exchange). A prefetched
    gather of layer ``l+1`` is issued as layer ``l`` reads its view and can hide behind ``overlap_fraction`` of
    layer ``l``'s forward compute.
    """
    n_layers = len(layer_forward)
    exposed = overlapped = 0.0
    demand = prefetched = 0
    for _ in range(n_microbatches):
        for layer in range(n_layers):
            if layer == 0 or not prefetch:
                exposed += gather_s
                demand += 1
            else:
                window = overlap_fraction * layer_forward[layer - 1]
                hidden = min(gather_s, window)
                overlapped += hidden
                exposed += gather_s - hidden
                prefetched += 1
        exposed += n_layers * scatter_s
    compute = n_microbatches * (sum(layer_forward) + sum(layer_backward))
    phase_b = compute + exposed + n_microbatches * other_comm_s
    return dict(
        compute_s=compute,
        exposed_s=exposed,
        overlapped_s=overlapped,
        other_comm_s=n_microbatches * other_comm_s,
        phase_b_s=phase_b,
        demand_gathers=demand,
        prefetched_gathers=prefetched,
    )
