"""Side-by-side CPU step times: baseline, PrefixFlow (library default / concat / split), PrefixGrouper.

    python -m harness.peers.timing [--compile] [--prompt 1280] [--response 256] [--n 16] [--repeats 3]

One model copy per system (same seed, fp32), a timed first call each (on a compiled model: compile + one
step, reported as ``first_call_s``) and ``--warmup`` more untimed calls, then ``repeats`` rounds that visit the systems in
alternating order; prints the median step time of each and its speedup over the baseline as JSON lines.
PrefixFlow and the baseline run one sequence per microbatch (``microbatch=1``, padded layout);
PrefixGrouper runs its one packed graph. With ``--compile`` the systems compile one after another in one
process and share dynamo's cache of ``TransformerBlock.forward`` (their different sequence lengths trigger
automatic-dynamic recompiles); for compiled numbers run one system per process (``--systems NAME``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import prefixflow as pf

from .prefix_grouper import train_group_prefix_grouper

SYSTEMS = ("baseline", "prefixflow", "prefixflow_concat", "prefixflow_split", "prefix_grouper")
ATTENTION = {"prefixflow": "auto", "prefixflow_concat": "concat", "prefixflow_split": "split"}


def make_step(name: str, model):
    if name == "prefix_grouper":
        return lambda group: train_group_prefix_grouper(model, group)
    if name == "baseline":
        return lambda group: pf.train_group(model, group, system="baseline", microbatch=1)
    return lambda group: pf.train_group(model, group, system="prefixflow", microbatch=1)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3:debugmodel")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1280)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls after the first (timed) call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.compile:
        # Four model copies share TransformerBlock.forward's dynamo cache (one graph per system/mode):
        # more entries than the default limit of 8 is expected here, not a recompilation bug.
        torch._dynamo.config.recompile_limit = 64
    names = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; valid: {SYSTEMS}")
    overrides = {"n_layers": args.layers, "max_seq_len": args.prompt + args.response}
    probe = pf.build_model(args.model, overrides=overrides)
    vocab = pf.model_args(probe).vocab_size
    group = pf.synthetic_group(vocab, args.prompt, [args.response] * args.n, seed=0)
    steps, first = {}, {}
    for name in names:
        config = pf.PrefixFlowConfig(attention=ATTENTION.get(name, "auto"))
        model = pf.apply_prefixflow(pf.build_model(args.model, overrides=overrides), config)
        if args.compile:
            pf.apply_compile(model)
        steps[name] = make_step(name, model)
        start = time.perf_counter()
        steps[name](group)
        first[name] = time.perf_counter() - start
        for _ in range(args.warmup):
            steps[name](group)
        model.zero_grad(set_to_none=True)
    times = {name: [] for name in names}
    cpu_times = {name: [] for name in names}  # process CPU seconds: less sensitive to other tenants
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            start, cpu = time.perf_counter(), time.process_time()
            steps[name](group)
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu)
    base = statistics.median(times["baseline"]) if "baseline" in times else float("nan")
    rows = []
    for name in names:
        median = statistics.median(times[name])
        row = {
            "system": name,
            "compiled": args.compile,
            "P": args.prompt,
            "S": args.response,
            "N": args.n,
            "layers": args.layers,
            "first_call_s": round(first[name], 3),
            "median_step_s": round(median, 4),
            "steps_s": [round(t, 4) for t in times[name]],
            "median_cpu_s": round(statistics.median(cpu_times[name]), 4),
            "speedup_vs_baseline": round(base / median, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
