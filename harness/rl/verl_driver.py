"""``python -m harness.rl.verl_driver --steps 20 --out DIR``: the one-process GRPO driver built from verl's
pieces (:mod:`harness.peers.verl_loop`: verl's engine and PrefixFlow's in lockstep, a JSONL log each), then its
logs as pf-bench records (Claim-2 kinds ``rl_step`` and ``rl_divergence``, preset
``verl_driver``), so Figures 7 and 8a draw verl's runs (``harness.figures.fig7.figure7_verl``,
``fig8.figure8a_verl``) beside our own loop's.

verl's timing keys map onto the loop's phases: ``gen`` -> generation, ``reward`` + ``adv`` -> reward,
``old_log_prob`` + ``ref`` -> evaluation (the actor and the frozen reference score the responses), ``update_actor``
-> update, sync 0 (the rollout is the actor's own module); ``step`` is verl's ``step`` timer. The raw keys are
kept as ``timing_s/<key>`` columns. verl's engine is system ``baseline``, PrefixFlow's ``prefixflow``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harness.records import write_records
from harness.run.columns import git_rev

__all__ = ["CELL", "PRESET", "driver_records", "main", "write_driver_records"]

PRESET = "verl_driver"
CELL = "verl_driver"
SYSTEMS = {"verl": "baseline", "prefixflow": "prefixflow"}
MODEL = "qwen3-tiny (verl driver)"


def _read_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"{path}: missing; run `python -m harness.rl.verl_driver --out {path.parent}` first")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{i}: not a JSON line of the {what} log") from None
    if not rows:
        raise ValueError(f"{path}: no steps logged")
    return rows


def driver_records(out: str | Path) -> list[dict[str, Any]]:
    """One ``rl_step`` row per engine and step and one ``rl_divergence`` row per step, from ``out``'s logs."""
    out = Path(out)
    cfg = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else None
    if cfg is None:
        raise ValueError(
            f"{out}/config.json: missing; run `python -m harness.rl.verl_driver --out {out}` first"
        )
    identity = f"{PRESET}-" + hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    base = {
        "cell_id": CELL,
        "spec": "verl_driver",
        "git_rev": cfg.get("git_rev") or git_rev(),  # the revision that ran, where the run noted it
        "host": socket.gethostname(),
        "device": "cpu",
        "model": MODEL,
        "model_overrides": json.dumps({"hidden_size": cfg["hidden"], "num_hidden_layers": cfg["layers"]}),
        "dtype": "fp32",
        "n": cfg["n"],
        "prompts_per_step": cfg["prompts_per_step"],
        "suffix_len": cfg["response_length"],
        "layout": "packed",
        "microbatch": cfg["micro_batch"],
        "compile": False,
        "ac": "none",
        "offload": False,
        "world_size": 1,
        "dp_replicate": 1,
        "dp_shard": 1,
        "seed": cfg["seed"],
        "status": "ok",
        "preset": PRESET,
        "identity": identity,
        "role": "compare",
        "threads": cfg["threads"],
        "config": json.dumps(cfg, sort_keys=True),
    }
    rows: list[dict[str, Any]] = []
    now = datetime.now(UTC).isoformat()
    for engine, system in SYSTEMS.items():
        for r in _read_jsonl(out / f"{engine}.jsonl", engine):
            t = {k: float(v) for k, v in r.items() if k.startswith("timing_s/")}
            p = float(r["prompt_length/mean"])
            rows.append(
                {
                    **base,
                    "record_kind": "rl_step",
                    "system": system,
                    "engine": engine,
                    "run": f"verl_driver_{engine}",
                    "step": int(r["step"]),
                    "timestamp": now,
                    "prefix_len": int(round(p)),
                    "prefix_ratio": p / (p + float(r["response_length/mean"])),
                    "reward_mean": float(r["critic/score/mean"]),
                    "loss": float(r["actor/pg_loss_sum"]),
                    "grad_norm": float(r["actor/grad_norm"]),
                    "responses_sha": r["responses_sha"],
                    "generation_s": t["timing_s/gen"],
                    "reward_s": t["timing_s/reward"] + t["timing_s/adv"],
                    "evaluation_s": t["timing_s/old_log_prob"] + t["timing_s/ref"],
                    "update_s": t["timing_s/update_actor"],
                    "sync_s": 0.0,
                    "step_s": t["timing_s/step"],
                    "step_time_s": t["timing_s/step"],
                    **t,
                }
            )
    for d in _read_jsonl(out / "divergence.jsonl", "divergence"):
        rows.append(
            {
                **base,
                "record_kind": "rl_divergence",
                "system": "prefixflow",
                "run": "verl_driver_verl~verl_driver_prefixflow",
                "run_a": "verl_driver_verl",
                "run_b": "verl_driver_prefixflow",
                "pair": "cross-system",
                "step": int(d["step"]),
                "timestamp": now,
                "max_abs": float(d["max_abs"]),
                "max_rel": float(d["max_rel"]),
                "rmse": float(d["rmse"]),
                "drift_a": float(d["drift_a"]),
                "drift_b": float(d["drift_b"]),
                "rmse_over_drift_a": d["rmse"] / d["drift_a"] if d["drift_a"] else None,
                "rmse_over_drift_b": d["rmse"] / d["drift_b"] if d["drift_b"] else None,
            }
        )
    return rows


def write_driver_records(out: str | Path) -> Path:
    """Write ``<out>/records/verl_driver.parquet`` (pf-bench's record format; ``pf-bench figures --results
    <out>`` draws it)."""
    out = Path(out)
    return write_records(out / "records" / f"{CELL}.parquet", driver_records(out), root=out)


def main(argv: list[str] | None = None) -> int:
    from harness.peers.verl_loop import DriverConfig

    parser = argparse.ArgumentParser(
        prog="python -m harness.rl.verl_driver", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the logs and records/")
    parser.add_argument(
        "--records-only", action="store_true", help="only turn the logs already in --out into records"
    )
    for key, default in vars(DriverConfig()).items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(default), default=default)
    args = vars(parser.parse_args(argv))
    out, records_only = args.pop("out"), args.pop("records_only")
    t0 = time.perf_counter()
    try:
        if not records_only:
            from harness.peers.verl_loop import run_driver

            run_driver(
                DriverConfig(**args),
                out,
                meta={"git_rev": git_rev(), "threads_env": os.environ.get("OMP_NUM_THREADS")},
            )
        path = write_driver_records(out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"records -> {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
