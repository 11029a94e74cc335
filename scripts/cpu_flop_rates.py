"""CPU time per FLOP: GEMM vs causal SDPA vs masked SDPA, forward + backward, on Claim 3's shapes.

Why PrefixFlow's CPU speedup is not its FLOP ratio: the work it removes is mostly GEMMs, the work it keeps is
mostly attention, and on small heads a CPU attention FLOP costs more time than a GEMM FLOP. This measures
both rates side by side (alternating, warm, median of repeats, one thread).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/cpu_flop_rates.py [--tokens 768 --dim 256 --heads 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    L, D, H = args.tokens, args.dim, args.heads
    hd = D // H

    x = torch.randn(L, D, requires_grad=True)
    w = torch.randn(D, 4 * D, requires_grad=True)
    q, k, v = (torch.randn(1, H, L, hd, requires_grad=True) for _ in range(3))
    causal_mask = torch.ones(L, L, dtype=torch.bool).tril()

    def gemm():
        (x @ w).sum().backward()

    def causal():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def masked():
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask).sum().backward()

    # forward + backward FLOPs: 3x the forward's
    pairs = L * (L + 1) // 2
    flops = {
        "gemm": 3 * 2 * L * D * 4 * D,
        "causal": 3 * 4 * H * hd * pairs,
        "masked": 3 * 4 * H * hd * pairs,
    }
    ops = {"gemm": gemm, "causal": causal, "masked": masked}
    for fn in ops.values():  # warm
        fn()
    times = {name: [] for name in ops}
    for _ in range(args.repeats):
        for name, fn in ops.items():
            times[name].append(_timed(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    rate = {name: flops[name] / med[name] / 1e9 for name in ops}
    print(f"tokens {L}, dim {D}, heads {H} (head_dim {hd}), fwd+bwd, median of {args.repeats}, 1 thread")
    for name in ops:
        print(f"  {name:7s} {med[name] * 1e3:8.2f} ms  {rate[name]:6.1f} GFLOP/s (useful FLOPs)")
    print(
        f"  time per useful FLOP vs GEMM: causal {rate['gemm'] / rate['causal']:.2f}x, "
        f"masked {rate['gemm'] / rate['masked']:.2f}x; masked vs causal {med['masked'] / med['causal']:.2f}x"
    )


if __name__ == "__main__":
    main()
