"""Profile one warm PrefixFlow (or baseline) training step on local ranks and print where rank 0's time went:
compute, waits on collectives, DTensor dispatch. It shows the fixed cost per microbatch that TP and ZeRO-3
FSDP add on CPU/gloo (docs/claim1.md, scale-out).

    python -m harness.local_ranks --nproc-per-node=2 scripts/profile_parallel_step.py --tp 2 --microbatch 1
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import prefixflow as pf
from prefixflow.parallel import init_distributed, parallelize
from prefixflow.parallel.dp import train_step

GROUPS = {
    "collectives": ("wait_tensor", "c10d::", "_c10d_functional::", "gloo"),
    "DTensor dispatch": ("PythonSubclass", "Redistribute", "_FromTorchTensor", "_ToTorchTensor", "DTensor"),
    "attention": ("scaled_dot_product",),
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--system", default="prefixflow", choices=("prefixflow", "baseline"))
    parser.add_argument("--microbatch", default="1", help="responses per microbatch, or 'all'")
    parser.add_argument("--prefix-len", type=int, default=1280)
    parser.add_argument("--suffix-len", type=int, default=256)
    parser.add_argument("--n", type=int, default=16)
    args = parser.parse_args()
    microbatch = None if args.microbatch == "all" else int(args.microbatch)
    torch.set_num_threads(1)
    init_distributed("cpu")
    model = pf.build_model("llama3:debugmodel", dtype=torch.float32, seed=0, overrides={"n_layers": 2})
    model = parallelize(pf.apply_prefixflow(model), {"tp": args.tp, "dp_shard": args.dp_shard})
    vocab = int(model.model_args.vocab_size)
    n_groups = args.dp_shard
    groups = [
        pf.synthetic_group(vocab, args.prefix_len, [args.suffix_len] * args.n, seed=i)
        for i in range(n_groups)
    ]

    def step() -> None:
        train_step(model, groups, system=args.system, microbatch=microbatch)
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / 1e6
        print(
            f"{args.system} tp={args.tp} dp_shard={args.dp_shard} microbatch={args.microbatch}: step {elapsed:.3f} s"
        )
        for name, keys in GROUPS.items():
            chosen = [e for e in events if any(k in e.key for k in keys)]
            seconds = sum(e.self_cpu_time_total for e in chosen) / 1e6
            calls = sum(e.count for e in chosen)
            print(f"  {name:16s} {seconds:7.3f} s self ({seconds / total:5.1%}), {calls} calls")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
