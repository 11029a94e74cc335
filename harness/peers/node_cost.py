"""Measure what a shared tree node costs, for ``build_tree(min_shared_tokens="auto")``.

    python -m harness.peers.node_cost [--lengths 1,2,4,8,16,32] [--repeats 15] [--dim 64] [--layers 2]

A tree of a prompt (``--prompt`` tokens, no loss) and ``--groups`` shared nodes of ``l`` trained tokens, each
with two trained leaves of ``--leaf`` tokens. For each ``l`` the same sequences are built twice: split
(``min_shared_tokens=1``: every shared node its own node) and merged (``min_shared_tokens=l+1``: each shared
node's tokens copied into its two leaves). PrefixFlow trains both, alternating, warm, ``--repeats`` each,
one thread; the median ``merged / split`` above 1 means splitting the node out paid. With two heirs a merge
recomputes ``l`` tokens, so the crossover length is the node's fixed cost in tokens
(``prefixflow.tree.build.AUTO_NODE_COST_TOKENS``). Prints one JSON line per length and the crossover.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import prefixflow as pf


def sequences(prompt: int, groups: int, shared: int, leaf: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(0, vocab, (n,), generator=gen)  # noqa: E731
    root = draw(prompt)
    seqs, masks = [], []
    for _ in range(groups):
        node = draw(shared)
        for _ in range(2):
            s = torch.cat([root, node, draw(leaf)])
            seqs.append(s)
            masks.append(torch.arange(s.numel()) >= prompt)
    return seqs, masks, torch.randn(len(seqs), generator=gen, dtype=torch.float64)


def crossover(rows: list[dict]) -> float | None:
    """The length where ``merged / split`` first reaches 1 (linear between the two lengths around it)."""
    for a, b in zip(rows, rows[1:], strict=False):
        if a["merged_over_split"] < 1.0 <= b["merged_over_split"]:
            x0, x1, y0, y1 = a["shared_len"], b["shared_len"], a["merged_over_split"], b["merged_over_split"]
            return x0 + (1.0 - y0) * (x1 - x0) / (y1 - y0)
    if rows and rows[0]["merged_over_split"] >= 1.0:
        return float(rows[0]["shared_len"])
    return None


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1,2,4,8,16,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--leaf", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    overrides = {
        "dim": args.dim,
        "n_layers": args.layers,
        "n_heads": 4,
        "vocab_size": 512,
        "max_seq_len": 1024,
    }
    model = pf.apply_prefixflow(pf.build_model("llama3:debugmodel", overrides=overrides, seed=0))
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        seqs, masks, adv = sequences(args.prompt, args.groups, length, args.leaf, 512)
        trees = {
            "split": pf.build_tree(seqs, adv, loss_masks=masks, min_shared_tokens=1),
            "merged": pf.build_tree(seqs, adv, loss_masks=masks, min_shared_tokens=length + 1),
        }
        assert (
            trees["split"].n_nodes == 1 + 3 * args.groups and trees["merged"].n_nodes == 1 + 2 * args.groups
        )
        times = {k: [] for k in trees}
        for r in range(args.warmup + args.repeats):
            for name in ("split", "merged") if r % 2 == 0 else ("merged", "split"):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                pf.train_group(model, trees[name], layout="packed")
                if r >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        split, merged = statistics.median(times["split"]), statistics.median(times["merged"])
        row = {"shared_len": length, "split_s": round(split, 5), "merged_s": round(merged, 5),
               "merged_over_split": round(merged / split, 4)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"crossover_tokens": crossover(rows)}), flush=True)
    return rows


if __name__ == "__main__":
    main()
