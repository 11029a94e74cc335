"""``pf-bench workload``: the paper's Table 1 statistics of a user's rollouts, checked against answers worked out
by hand, in every accepted layout and format, on a trace the project's own multi-turn RL loop writes, against
the cost model with ``--estimate``, and refusing bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import REPO
from typer.testing import CliRunner

import prefixflow as pf
from harness.cli import app
from harness.costmodel import flops
from harness.rl.run import run_claim2
from harness.rl.spec import load_rl_spec, parse_rl_spec
from harness.rl.trace import load_trace
from harness.rollout_stats import read_rollouts, representative, workload_stats
from harness.rollout_stats.read import Group, Rollouts
from harness.rollout_stats.stats import trie_tokens
from prefixflow.model.models import resolve_model_args

runner = CliRunner()

# Group a: an 8-token prompt, responses of 2, 8 and 24 tokens (ratios 0.8, 0.5, 0.25); group b: a 3-token
# prompt, responses of 1 and 3 (0.75, 0.5). Sorted ratios 0.25, 0.5, 0.5, 0.75, 0.8; numpy's linear
# percentile at q sits at index q/100 * 4.
PROMPTS = {"a": list(range(1, 9)), "b": [1, 2, 3]}
RESPONSES = {"a": [[9, 10], list(range(20, 28)), list(range(30, 54))], "b": [[4], [5, 6, 7]]}
EXPECTED = {
    "samples": 5,
    "groups": 2,
    "prefix_ratio": {"p10": 0.35, "p25": 0.5, "p50": 0.5, "p75": 0.75, "p90": 0.78, "min": 0.25, "max": 0.8},
    "group_size": {"p50": 2.5, "min": 2, "max": 3},
    "baseline_tokens": (10 + 16 + 32) + (4 + 6),  # 68
    "shared_tokens": (8 + 2 + 8 + 24) + (3 + 1 + 3),  # 49
    "tree_tokens": 49,  # no two responses of a group share a first token
}


def rows():
    for g, prompt in PROMPTS.items():
        for r in RESPONSES[g]:
            yield g, prompt, r


def _check(stats, tree_tokens=EXPECTED["tree_tokens"]):
    assert (stats.samples, stats.groups) == (EXPECTED["samples"], EXPECTED["groups"])
    for field in ("prefix_ratio", "group_size"):
        got = getattr(stats, field)
        for k, v in EXPECTED[field].items():
            assert got[k] == pytest.approx(v, abs=1e-12), (field, k)
    assert (stats.baseline_tokens, stats.shared_tokens) == (68, 49)
    assert stats.tree_tokens == tree_tokens
    assert stats.shared_fraction == pytest.approx(1 - 49 / 68)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _verl_records(pad: int = 0) -> list[dict]:
    """verl's DataProto rows: prompts left-padded to a width, responses right-padded, attention_mask over both."""
    out = []
    pw, rw = 8 + pad, 24 + pad
    for g, prompt, r in rows():
        prompts = [0] * (pw - len(prompt)) + prompt
        responses = r + [0] * (rw - len(r))
        mask = [0] * (pw - len(prompt)) + [1] * len(prompt) + [1] * len(r) + [0] * (rw - len(r))
        out.append({"prompts": prompts, "responses": responses, "attention_mask": mask, "uid": f"u-{g}"})
    return out


LAYOUT_RECORDS = {
    "prompt-response": lambda: [{"group_id": g, "prompt_ids": p, "response_ids": r} for g, p, r in rows()],
    # TRL's names (GRPOTrainer's prompt_ids/completion_ids) with its step column; grouped by identical prompts
    "trl": lambda: [{"step": 3, "prompt_ids": p, "completion_ids": r} for _, p, r in rows()],
    "verl": _verl_records,
    "sequences-prompt": lambda: [{"uid": g, "input_ids": p + r} for g, p, r in rows()],
}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("layout", ["prompt-response", "trl", "verl"])
def test_the_hand_made_file_in_every_layout_and_format(tmp_path, layout, fmt):
    records = LAYOUT_RECORDS[layout]()
    path = tmp_path / f"r.{fmt}"
    if fmt == "jsonl":
        _jsonl(path, records)
    else:
        pd.DataFrame(records).to_parquet(path)
    rollouts = read_rollouts(path)
    assert rollouts.layout == {"trl": "prompt-response"}.get(layout, layout)
    _check(workload_stats(rollouts))


def test_sequences_take_the_groups_common_prefix_as_the_prefix(tmp_path):
    """Without a prompt boundary the prefix is the group's longest common prefix: group b's responses 4 and
    5, 6, 7 differ at once (prefix 3, as above); group a's too; a group of one has P = 0."""
    records = LAYOUT_RECORDS["sequences-prompt"]() + [{"uid": "c", "input_ids": [7, 7, 7]}]
    stats = workload_stats(read_rollouts(_jsonl(tmp_path / "s.jsonl", records)))
    assert stats.layout == "sequences" and stats.singleton_groups == 1
    assert stats.prefix_ratio["min"] == 0.0 and stats.prefix_len["max"] == 8
    assert (stats.baseline_tokens, stats.shared_tokens, stats.tree_tokens) == (71, 52, 52)


def test_a_step_column_splits_groups(tmp_path):
    """The same group id (or prompt) at two steps is two groups; keys are compared as (step, id), so step
    "1/a" with id "b" and step "1" with id "a/b" stay apart."""
    records = [
        {"step": 1, "group_id": "g", "token_ids": [1, 2, 3]},
        {"step": 1, "group_id": "g", "token_ids": [1, 2, 4]},
        {"step": 2, "group_id": "g", "token_ids": [1, 2, 5]},
        {"step": "1/a", "group_id": "b", "token_ids": [6]},
        {"step": "1", "group_id": "a/b", "token_ids": [7]},
    ]
    stats = workload_stats(read_rollouts(_jsonl(tmp_path / "s.jsonl", records)))
    assert (stats.groups, stats.singleton_groups, stats.shared_tokens) == (4, 3, (2 + 1 + 1) + 3 + 1 + 1)


def test_a_hand_made_tree(tmp_path):
    """Three paths that share 1, 2 and then split: the flat share is the common prefix (2 tokens), the trie
    holds 1 2 | 3 | 4 5 | 6 7 | 8 9 = 9 of the 14 tokens; duplicates and a path that is a prefix of another
    add nothing to the trie."""
    records = [
        {"group_id": "t", "token_ids": [1, 2, 3, 4, 5]},
        {"group_id": "t", "token_ids": [1, 2, 3, 6, 7]},
        {"group_id": "t", "token_ids": [1, 2, 8, 9]},
        {"group_id": "d", "token_ids": [5, 6]},
        {"group_id": "d", "token_ids": [5, 6]},
        {"group_id": "d", "token_ids": [5, 6, 7]},
    ]
    stats = workload_stats(read_rollouts(_jsonl(tmp_path / "t.jsonl", records)))
    assert stats.baseline_tokens == 14 + 7
    assert stats.shared_tokens == (2 + 3 + 3 + 2) + (2 + 0 + 0 + 1)
    assert stats.tree_tokens == 9 + 3 and stats.tree_groups == 1
    assert stats.tree_shared_fraction == pytest.approx(1 - 12 / 21)
    assert stats.prefix_ratio["p50"] == pytest.approx(np.median([2 / 5, 2 / 5, 2 / 4, 1.0, 1.0, 2 / 3]))


@pytest.fixture
def one_thread():
    """The loop on one torch thread: on 2 shared cores, conftest's 2 threads make it 5x slower under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_multiturn_trace_written_by_the_projects_rl_loop(tmp_path, one_thread):
    """The multi-turn loop's trace (its paths share the system prompt and earlier turns): the trie's tokens
    equal the tokens of ``prefixflow.build_tree``'s nodes for every group, and fewer than the flat share."""
    raw = load_rl_spec(REPO / "experiments" / "claim2.yaml", "multiturn-smoke").model_dump(
        mode="json", exclude={"presets"}
    )
    raw.update(
        trainers=["baseline"],
        trace={"steps": 1, "runs": [{"dtype": "fp32"}], "systems": ["baseline"]},
        loop={**raw["loop"], "steps": 1},
        warm_start={**raw["warm_start"], "steps": 2},
        checkpoint_every=1,
    )
    folder = run_claim2(parse_rl_spec(raw), None, tmp_path, log=lambda _: None)
    trace_dir = folder / "_state" / "traces" / "baseline-fp32-s0"
    stats = workload_stats(read_rollouts(trace_dir))
    trace = load_trace(trace_dir)
    groups = trace.groups(trace.manifest.steps[0])
    node_tokens = 0
    for g in groups:
        paths = [torch.cat([g.prompt, r]) for r in g.responses]
        tree = pf.build_tree(paths, [0.0] * len(paths))
        node_tokens += sum(len(s) for s in tree.segments)
    assert stats.layout == "pf-bench-trace" and stats.groups == len(groups)
    assert stats.prefix_len["min"] == stats.prefix_len["max"] == len(groups[0].prompt)
    assert stats.tree_tokens == node_tokens < stats.shared_tokens < stats.baseline_tokens
    assert stats.tree_groups == len(groups)


def _brute_trie(seqs: list[list[int]]) -> int:
    return len({tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=7), min_size=1, max_size=5),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 3),
)
def test_property_trie_and_shares_are_bounded(groups, prompt_len):
    """The trie counts each distinct prefix once (against a brute-force set of prefixes); trie <= flat share
    <= baseline; every ratio lies in [0, 1]. Small alphabets make shared prefixes frequent."""
    made = []
    for i, seqs in enumerate(groups):
        arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
        lens = [min(prompt_len, len(s)) for s in seqs] if i % 2 else None
        made.append(Group(str(i), arrays, lens))
        assert trie_tokens(arrays) == _brute_trie(seqs)
    stats = workload_stats(Rollouts("test", made))
    assert stats.tree_tokens <= stats.shared_tokens <= stats.baseline_tokens
    assert 0.0 <= stats.prefix_ratio["min"] <= stats.prefix_ratio["max"] <= 1.0
    assert stats.tree_shared_fraction >= stats.shared_fraction >= 0.0


def test_cli_prints_the_tables_and_json(tmp_path):
    path = _jsonl(tmp_path / "r.jsonl", LAYOUT_RECORDS["prompt-response"]())
    res = runner.invoke(app, ["workload", str(path)])
    assert res.exit_code == 0, res.output
    assert "prefix ratio" in res.output and "27.94%" in res.output  # 1 - 49/68
    res = runner.invoke(app, ["workload", str(path), "--json"])
    out = json.loads(res.stdout)
    assert out["prefix_ratio"]["p90"] == pytest.approx(0.78) and out["estimate"] is None


TINY = ["--model", "llama3:debugmodel", "--override", "dim=32", "--override", "n_layers=2", "--override",
        "n_heads=2", "--override", "n_kv_heads=1", "--override", "vocab_size=64"]  # fmt: skip


def test_estimate_reports_the_cost_models_saving_at_the_median_cell(tmp_path):
    """P, S, N = the medians (8, 3, 2.5 -> 3), and the FLOP saving is the cost model's for that cell."""
    path = _jsonl(tmp_path / "r.jsonl", LAYOUT_RECORDS["prompt-response"]())
    assert representative(workload_stats(read_rollouts(path))) == (8, 3, 3)
    res = runner.invoke(app, ["workload", str(path), *TINY, "--estimate", "--json"])
    assert res.exit_code == 0, res.output
    est = json.loads(res.stdout)["estimate"]
    shape = flops.as_shape(
        resolve_model_args(
            "llama3:debugmodel", {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 64}
        )
    )
    base, ours = (flops.model_flops(s, shape, 8, 3, 3) for s in ("baseline", "prefixflow"))
    assert (est["prefix_len"], est["suffix_len"], est["n"]) == (8, 3, 3)
    assert est["systems"]["baseline"]["model_flops"] == base
    assert est["flop_saving"] == pytest.approx(1 - ours / base, rel=1e-12)
    assert est["counted_flop_saving"] == pytest.approx(est["flop_saving"], rel=1e-12)  # counted = modelled
    for system in ("baseline", "prefixflow"):
        assert est["systems"][system]["peak_mem_phase_b_bytes"] > 0


def _parquet(path: Path, records: list[dict]) -> Path:
    pd.DataFrame(records).to_parquet(path)
    return path


BAD = {
    "missing file": (lambda d: d / "nope.jsonl", "no such file"),
    "unknown extension": (lambda d: _jsonl(d / "r.csv", [{"a": 1}]), "unknown extension '.csv'"),
    "no known layout": (lambda d: _jsonl(d / "r.jsonl", [{"text": "hi"}]), "no known rollout layout"),
    "negative id": (
        lambda d: _jsonl(
            d / "r.jsonl", [{"group_id": 1, "input_ids": [1, 2]}, {"group_id": 1, "input_ids": [3, -1]}]
        ),
        "row 2: input_ids[1] is -1",
    ),
    "float id": (
        lambda d: _jsonl(d / "r.jsonl", [{"group_id": 1, "input_ids": [1.5]}]),
        "input_ids[0] is 1.5",
    ),
    "bool id": (
        lambda d: _jsonl(d / "r.jsonl", [{"group_id": 1, "input_ids": [True]}]),
        "input_ids[0] is True",
    ),
    "huge id": (
        lambda d: _jsonl(d / "r.jsonl", [{"group_id": 1, "input_ids": [2**40]}]),
        "ints in [0, 2^31)",
    ),
    "ids not a list": (
        lambda d: _jsonl(d / "r.jsonl", [{"group_id": 1, "input_ids": "12"}]),
        "must be a list",
    ),
    "row lacks a field": (
        lambda d: _jsonl(d / "r.jsonl", [{"group_id": 1, "input_ids": [1]}, {"input_ids": [2]}]),
        "row 2 lacks 'group_id'",
    ),
    "bad group id": (
        lambda d: _jsonl(d / "r.jsonl", [{"group_id": None, "input_ids": [1]}]),
        "row 1: group_id",
    ),
    "not json": (lambda d: (d / "r.jsonl").write_text('{"a": [1,\n') and d / "r.jsonl", "line 1 is not JSON"),
    "not an object": (
        lambda d: (d / "r.jsonl").write_text("[1, 2]\n") and d / "r.jsonl",
        "not a JSON object",
    ),
    "deep nesting": (lambda d: (d / "r.jsonl").write_text("[" * 100000 + "\n") and d / "r.jsonl", "not JSON"),
    "empty": (lambda d: (d / "r.jsonl").write_text("\n") and d / "r.jsonl", "no rows"),
    "empty sample": (lambda d: _jsonl(d / "r.jsonl", [{"group_id": 1, "input_ids": []}]), "no tokens"),
    "verl mask width": (
        lambda d: _jsonl(d / "r.jsonl", [{**_verl_records()[0], "attention_mask": [1, 1]}]),
        "attention_mask has 2 entries",
    ),
    "verl mask values": (
        lambda d: _jsonl(d / "r.jsonl", [{**_verl_records()[0], "attention_mask": [2] * 32}]),
        "only 0 and 1",
    ),
    "parquet negative id": (
        lambda d: _parquet(
            d / "r.parquet", [{"uid": "a", "token_ids": [1, 2]}, {"uid": "a", "token_ids": [3, -4]}]
        ),
        "row 2: token_ids[1] is -4",
    ),
    "parquet null ids": (
        lambda d: _parquet(
            d / "r.parquet", [{"uid": "a", "token_ids": [1]}, {"uid": "a", "token_ids": None}]
        ),
        "row 2: token_ids is null",
    ),
    "parquet text ids": (
        lambda d: _parquet(d / "r.parquet", [{"uid": "a", "token_ids": "1 2"}]),
        "column token_ids must be a list of integer token ids",
    ),
    "not parquet": (
        lambda d: (d / "r.parquet").write_text("hello") and d / "r.parquet",
        "not a readable Parquet",
    ),
    "folder without manifest": (lambda d: d, "not a pf-bench rl trace"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_in_one_line(tmp_path, case):
    make, words = BAD[case]
    res = runner.invoke(app, ["workload", str(make(tmp_path))])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.output, res.stderr
    assert lines[0].startswith("error: ROLLOUTS:") and words in lines[0], lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--max-rows", "4"], "more than 4 rows"),
        (["--max-bytes", "100"], "over the limit of 100"),
        (["--estimate"], "--estimate needs --model"),
        (["--model", "llama3:debugmodel"], "--estimate needs --model"),
        (["--model", "llama3:nope", "--estimate"], "--model"),
        (["--model", "llama3:debugmodel", "--override", "max_seq_len=8", "--estimate"], "max_seq_len=8"),
    ],
)
def test_limits_and_option_errors_are_one_line(tmp_path, args, words):
    for fmt, write in (("jsonl", _jsonl), ("parquet", _parquet)):
        path = write(tmp_path / f"r.{fmt}", LAYOUT_RECORDS["prompt-response"]())
        res = runner.invoke(app, ["workload", str(path), *args])
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], res.output


def test_the_documented_example():
    """docs/workload.md's numbers for experiments/workloads/example-rollouts.jsonl."""
    stats = workload_stats(read_rollouts(REPO / "experiments" / "workloads" / "example-rollouts.jsonl"))
    assert (stats.samples, stats.groups, stats.tree_groups) == (16, 4, 1)
    assert (stats.baseline_tokens, stats.shared_tokens, stats.tree_tokens) == (5678, 2798, 2678)
    assert round(stats.prefix_ratio["p50"], 4) == 0.7508 and round(stats.prefix_ratio["p10"], 4) == 0.155
    assert representative(stats) == (200, 56, 4)
    doc = (REPO / "docs" / "workload.md").read_text()
    assert "0.7508" in doc and "2798" in doc and "P=200, S=56, N=4" in doc


def test_the_model_is_checked_before_the_file_is_read(tmp_path):
    res = runner.invoke(
        app, ["workload", str(tmp_path / "absent.jsonl"), "--model", "llama3:nope", "--estimate"]
    )
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "--model" in lines[0] and "absent" not in lines[0]
