"""A/B of the Phase-A early stop (on vs off), 1 thread, alternating, warm, median of 5 (README, Claim 3).

Run: .venv/bin/python scripts/ab_phase_a_stop.py
"""
import statistics, torch, prefixflow as pf
import prefixflow.schedule as sch
torch.set_num_threads(1)
m = pf.build_model("llama3:debugmodel", overrides={"n_layers": 2}); pf.apply_prefixflow(m)
g = pf.synthetic_group(2048, 1281, [256] * 16, seed=0)
real = sch._last_needed_layer
times = {"stop": [], "full": []}
for rep in range(6):
    for mode in ("stop", "full"):
        sch._last_needed_layer = real if mode == "stop" else (lambda *a: None)
        m.zero_grad(set_to_none=True)
        s = pf.train_group(m, g, microbatch=1)
        if rep:
            times[mode].append((s.phase_times["A"], s.phase_times["C"], s.total_s))
for mode, t in times.items():
    a, c, tot = (statistics.median(x[i] for x in t) for i in range(3))
    print(f"{mode}: phase A {a:.3f}s  phase C {c:.3f}s  step {tot:.3f}s")
