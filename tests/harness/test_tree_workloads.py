"""Tree workloads (harness.workloads), the trees spec (experiments/trees.yaml) and one tree cell end to end."""

from __future__ import annotations

import pytest
import torch

from harness.spec.load import SpecError, expand, load_spec, parse_spec
from harness.workloads import AgenticShape, FlatShape, SearchShape, SharedContextShape

SPEC = "experiments/trees.yaml"


def test_agentic_shape_turns_masks_and_statistics():
    shape = AgenticShape(system_len=10, turns=3, assistant_len=2, reply_len=3, branch=2, branch_at=[0, 2])
    w = shape.generate(50)
    assert len(w.sequences) == 4 and all(s.numel() == 10 + 3 * 5 for s in w.sequences)
    for m in w.loss_masks:  # system prompt and replies untrained, assistant turns trained
        want = torch.tensor([False] * 10 + ([True] * 2 + [False] * 3) * 3)
        assert torch.equal(m, want)
    st = w.stats()
    unique = 10 + 2 * 5 + 2 * 5 + 4 * 5  # turn 0 branches (2), turn 1 follows each, turn 2 branches again
    assert st["unique_tokens"] == unique and st["path_tokens"] == 4 * 25
    assert st["shared_fraction"] == pytest.approx(1 - unique / 100)
    assert st["levels"] == 3 and shape.nominal() == (10, 15, 4)


def test_shapes_are_seeded_and_nominal_matches_generated():
    shapes = [
        AgenticShape(system_len=8, turns=2, assistant_len=3, reply_len=2, branch=3, branch_at=[1]),
        SearchShape(prompt_len=6, depth=2, branch=3, segment_len=4),
        SharedContextShape(context_len=9, prompts=3, prompt_len=2, responses=2, response_len=3),
        FlatShape(prompt_len=7, n=5, response_len=4),
    ]
    for shape in shapes:
        a, b = shape.generate(1000), shape.generate(1000)
        assert all(torch.equal(x, y) for x, y in zip(a.sequences, b.sequences, strict=True))
        other = shape.model_copy(update={"seed": 1}).generate(1000)
        assert not torch.equal(a.sequences[0], other.sequences[0])
        st = a.stats()
        trunk, rest, paths = shape.nominal()
        assert (st["paths"], st["trunk_len"], st["max_path_len"]) == (paths, trunk, trunk + rest), shape.kind
    assert SearchShape(prompt_len=6, depth=2, branch=3, segment_len=4).generate(1000).stats()["levels"] == 3
    assert (
        SharedContextShape(context_len=9, prompts=3, prompt_len=2, responses=2, response_len=3)
        .generate(1000)
        .stats()["unique_tokens"]
        == 9 + 3 * 2 + 6 * 3
    )


def test_trees_spec_expands_and_smoke_preset():
    spec = load_spec(SPEC)
    cells = expand(spec)
    assert len(cells) == 7 * 2 * 3 + 7 and {c.tree.kind for c in cells} == {
        "agentic",
        "search",
        "shared_context",
        "flat",
    }
    assert set(spec.systems) == {
        "baseline",
        "prefixflow",
        "prefixflow_auto",
        "prefixflow_flat",
        "tree_mask",
        "dfs_relay",
    }
    smoke = load_spec(SPEC, "smoke")
    assert smoke.name == "trees-smoke" and len(expand(smoke)) == 2
    assert len({c.cell_id for c in cells}) == len(cells)


def test_trees_spec_errors_name_the_field():
    base = {"name": "t", "axes": {"models": [{"name": "llama3:debugmodel"}]}}
    bad = {**base, "axes": {**base["axes"], "trees": [{"kind": "search", "depth": 2, "fanout": 3}]}}
    with pytest.raises(SpecError, match="fanout"):
        parse_spec(bad)
    both = {**base, "axes": {**base["axes"], "trees": [{"kind": "flat"}], "n": [4]}}
    with pytest.raises(SpecError, match="drop"):
        parse_spec(both)
    with pytest.raises(SpecError, match="'n'"):
        parse_spec({**base, "axes": {**base["axes"], "lengths": [{"prefix": 4, "suffix": 4}]}})


def test_tree_cell_records_every_system():
    from harness.run.tree_cell import run_tree_cell
    from prefixflow.tree.plan import TreeRows

    cell = expand(load_spec(SPEC, "smoke"))[0].model_copy(update={"device": "cpu"})
    rows = run_tree_cell(cell)
    assert [r["system"] for r in rows] == list(cell.systems)
    assert all(r["status"] == "ok" for r in rows), [r.get("error") for r in rows]
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])  # one objective on one tree (fp32)
    by = {r["system"]: r for r in rows}
    tree = cell.tree.generate(128).tree()
    leaves = tree.n_nodes - len(TreeRows(tree).cached)  # a leaf's last token never runs
    assert by["prefixflow"]["tree_unique_tokens"] == tree.unique_tokens
    assert by["prefixflow"]["trunk_tokens"] == tree.unique_tokens - leaves
    assert (
        by["baseline"]["trunk_tokens"]
        > by["prefixflow_flat"]["trunk_tokens"]
        > by["prefixflow"]["trunk_tokens"]
    )
    assert by["prefixflow"]["level_times"] and by["baseline"]["level_times"] is None
    assert all(r["peak_mem_bytes"] > 0 and r["counted_flops"] > 0 for r in rows)


def test_baseline_runs_a_tree_padded_whatever_the_cell_layout():
    from harness.contenders import get_contender

    cell = expand(load_spec(SPEC, "smoke"))[0]
    tree = cell.tree.generate(128).tree()
    assert cell.layout == "packed"
    assert get_contender("baseline").layout_for(tree, cell) == "padded"
    assert get_contender("prefixflow").layout_for(tree, cell) == "packed"


def test_smoke_preset_sweeps_through_the_cli(tmp_path):
    """CI: `pf-bench sweep experiments/trees.yaml --preset smoke` records every cell ok, then figures draw."""
    from typer.testing import CliRunner

    from harness.cli import app

    runner = CliRunner()
    out = tmp_path / "results"
    args = ["sweep", SPEC, "--preset", "smoke", "--out", str(out), "--executor", "debug"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert len(list((out / "trees-smoke").glob("*.parquet"))) == 2
    res = runner.invoke(app, ["figures", "--results", str(out), "--out", str(tmp_path / "fig")])
    assert res.exit_code == 0, res.output
    assert {"trees_speedup.png", "trees_time_memory.png"} <= {p.name for p in (tmp_path / "fig").iterdir()}
