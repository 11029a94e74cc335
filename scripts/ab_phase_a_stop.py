"""A/B of the Phase-A early stop (on vs off), 1 thread, alternating, warm, median of 5 (docs/claim3.md).

Run: .venv/bin/python scripts/ab_phase_a_stop.py
"""

import statistics

import torch

import prefixflow as pf
import prefixflow.schedule.phases as phases


def main() -> None:
    torch.set_num_threads(1)
    model = pf.apply_prefixflow(pf.build_model("llama3:debugmodel", overrides={"n_layers": 2}))
    group = pf.synthetic_group(2048, 1281, [256] * 16, seed=0)
    stop_at_last_kv = phases._stop_after
    times: dict[str, list[tuple[float, float, float]]] = {"stop": [], "full": []}
    try:
        for rep in range(6):  # the first round is warm-up
            for mode in ("stop", "full"):
                phases._stop_after = stop_at_last_kv if mode == "stop" else (lambda *_: None)
                model.zero_grad(set_to_none=True)
                stats = pf.train_group(model, group, microbatch=1)
                if rep:
                    times[mode].append((stats.phase_times["A"], stats.phase_times["C"], stats.total_s))
    finally:
        phases._stop_after = stop_at_last_kv
    for mode, samples in times.items():
        a, c, total = (statistics.median(s[i] for s in samples) for i in range(3))
        print(f"{mode}: phase A {a:.3f}s  phase C {c:.3f}s  step {total:.3f}s")


if __name__ == "__main__":
    main()
