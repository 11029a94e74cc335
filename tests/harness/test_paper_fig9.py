"""Figure 9 at the paper's size (``harness.figures.paper_fig9``): at one response per Phase-B microbatch a
step's counted FLOPs and modelled time are affine in N, so N = 2 and 4 give every N; the table keeps a count
where there is one, states the extension's gap to it, and sets the paper's eager speedups beside ours."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness.costmodel.roofline import H20_HBM_BYTES
from harness.figures import FIGURES
from harness.figures.paper_fig9 import affine_in_n, figure9_paper, paper_fig9_table
from harness.records import ESTIMATE_METER

SYSTEMS = ("baseline", "prefixflow_concat", "prefixflow")


@pytest.fixture(scope="module")
def tiny_records():
    """Estimated records of a tiny Llama at N = 2, 4 and 8, one response per microbatch, SAC."""
    from harness.estimate import estimate_cell
    from harness.spec.cell import Cell, ModelSpec

    tiny = ModelSpec(name="llama3:debugmodel", overrides={"dim": 32, "n_layers": 2, "n_heads": 2,
                                                          "vocab_size": 64})  # fmt: skip
    rows = []
    for n in (2, 4, 8):
        cell = Cell(spec="paper_fig9", model=tiny, prefix_len=80, suffix_len=16, n=n, microbatch=1,
                    systems=list(SYSTEMS), dtype="bf16", ac="selective", warmup=0, repeats=1,
                    device="cpu")  # fmt: skip
        rows += estimate_cell(cell)
    df = pd.DataFrame(rows)
    assert set(df["status"]) == {"ok"} and set(df["mem_meter"]) == {ESTIMATE_METER}
    return df


def test_flops_and_modelled_time_are_affine_in_n_so_two_counts_give_the_third(tiny_records):
    values = ["counted_flops", "modelled_time_s", "modelled_bytes"]
    line = affine_in_n(tiny_records[tiny_records["n"] < 8], [8], values).set_index("system")
    counted = tiny_records[tiny_records["n"] == 8].set_index("system")
    # The one term that is not affine: each microbatch's loss reads the group's N-vectors whole (advantages
    # cast to the step's dtype, then indexed; 20 bytes per response), 20·N² bytes a step. A line through N = 2
    # and 4 misses 20·N² by 20·24 bytes at N = 8: 1.2e-10 s at 4 TB/s, 6e-6 of this tiny step, 1e-12 at 8B.
    quadratic = 20 * (8**2 - (2**2 + 3 * (4**2 - 2**2)))
    for system in SYSTEMS:
        assert line.loc[system, "counted_flops"] == counted.loc[system, "counted_flops"]  # exactly
        assert counted.loc[system, "modelled_bytes"] - line.loc[system, "modelled_bytes"] == quadratic
        gap_s = counted.loc[system, "modelled_time_s"] - line.loc[system, "modelled_time_s"]
        assert gap_s == pytest.approx(quadratic / H20_HBM_BYTES, rel=1e-6)  # those bytes are all it misses
    # the step is not proportional to N (the prefix runs once): a line through the origin would miss
    pf = tiny_records[tiny_records["system"] == "prefixflow"].set_index("n")["counted_flops"]
    assert pf[8] != 4 * pf[2]


def test_the_table_keeps_counts_states_the_gap_and_extends_the_rest(tiny_records):
    df = pd.concat([tiny_records, tiny_records.assign(spec="other", counted_flops=1.0)], ignore_index=True)
    t = paper_fig9_table(df, ns=[2, 4, 8, 16]).set_index("n")
    assert t["counted"].tolist() == [True, True, True, False]
    assert np.isnan(t.loc[2, "extension_gap"]) and np.isnan(t.loc[4, "extension_gap"])  # the line's anchors
    assert np.isnan(t.loc[16, "extension_gap"])  # nothing to check it against
    assert 0 < t.loc[8, "extension_gap"] < 1e-5  # the loss's 20·N² bytes (the test above)
    n8 = tiny_records[tiny_records["n"] == 8].set_index("system")
    assert (
        t.loc[8, "flops_speedup_split"]
        == n8.loc["baseline", "counted_flops"] / n8.loc["prefixflow", "counted_flops"]
    )
    assert t.loc[8, "modelled_speedup_concat"] == (
        n8.loc["baseline", "modelled_time_s"] / n8.loc["prefixflow_concat", "modelled_time_s"]
    )
    assert t["flops_speedup_split"].is_monotonic_increasing  # the prefix amortizes over more responses
    assert t["paper_eager"].isna().all()  # the tiny split is not one of the paper's


def _synthetic(prefix_len: int) -> list[dict]:
    """Records at N = 2 and 4 whose values are known lines: baseline 10·N, PrefixFlow 6 + 2·N."""
    rows = []
    for n in (2, 4):
        for system, value in (("baseline", 10.0 * n), ("prefixflow_concat", 6.0 + 2 * n),
                              ("prefixflow", 6.0 + 2 * n)):  # fmt: skip
            rows.append({"spec": "paper_fig9", "status": "ok", "mem_meter": ESTIMATE_METER, "model": "m",
                         "system": system, "prefix_len": prefix_len, "suffix_len": 12288 - prefix_len, "n": n,
                         "counted_flops": value, "modelled_time_s": value / 100, "git_rev": "abc"})  # fmt: skip
    return rows


def test_the_papers_eager_speedups_sit_beside_the_extension(tmp_path):
    t = paper_fig9_table(pd.DataFrame(_synthetic(10240) + _synthetic(2048))).set_index(["prefix_len", "n"])
    assert t.loc[(10240, 16), "modelled_speedup_concat"] == pytest.approx(160 / 38)
    assert t.loc[(10240, 128), "flops_speedup_split"] == pytest.approx(1280 / 262)
    assert t.loc[(10240, 16), "paper_eager"] == 3.800 and t.loc[(2048, 128), "paper_eager"] == 1.170
    assert t.loc[(10240, 32), "modelled_concat/paper"] == pytest.approx(320 / 70 / 4.115)
    assert np.isnan(t.loc[(2048, 16), "paper_eager"])
    assert [p.name for p in figure9_paper(pd.DataFrame(_synthetic(10240)), tmp_path)] == [
        "fig9a_paper_scale.png"
    ]
    assert FIGURES["fig9a_paper"] is figure9_paper


def test_measured_records_and_the_cpu_figure_9_stay_apart():
    from harness.figures.common import pair_speedups

    measured = [dict(r, mem_meter="live-bytes", step_time_s=1.0) for r in _synthetic(10240)]
    assert paper_fig9_table(pd.DataFrame(measured)).empty  # only estimates are modelled
    assert pair_speedups(pd.DataFrame(_synthetic(10240))).empty  # the CPU Figure 9 never reads estimates
