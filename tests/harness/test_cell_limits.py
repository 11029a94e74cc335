"""Issue 36.5 / 36.6: a cell's paths and tokens are bounded at spec load (naming the block), the memory floor
counts the attention masks a layout builds, and no layout builds a mask plain causal attention does not need."""

from __future__ import annotations

import pytest
import torch

from harness.run.memory import MemoryRefusal, cell_need, masks_need, meta_shape, preflight_cell
from harness.spec.cell import Cell, ModelSpec
from harness.spec.load import SpecError, parse_spec
from prefixflow.tree.layouts import Row, lay_out, mask_bytes

MODEL = {"name": "llama3:debugmodel"}


def _spec(**axes) -> dict:
    return {"name": "limits", "axes": {"models": [MODEL], **axes}}


@pytest.mark.parametrize(
    "axes, text",
    [
        (
            {"trees": [{"kind": "search", "prompt_len": 4, "depth": 12, "branch": 4, "segment_len": 1}]},
            r"axes.trees.0: 16,777,216 paths per cell, more than limits.max_paths=100,000",
        ),
        (
            {"trees": [{"kind": "search", "depth": 64, "branch": 64}]},
            r"axes.trees.0: .* more than limits.max_paths",
        ),
        (
            {"lengths": [{"prefix": 500_000, "suffix": 500_000}], "n": [11]},
            r"axes.n: 11 paths x 1,000,000 tokens = 11,000,000 path tokens per cell, more than limits.max_tokens",
        ),
    ],
)
def test_oversized_cells_are_refused_at_load_naming_the_block(axes, text):
    with pytest.raises(SpecError, match=text) as err:
        parse_spec(_spec(**axes))
    assert "validation error for" not in str(err.value)


def test_limits_are_configurable():
    tree = {"kind": "search", "prompt_len": 4, "depth": 12, "branch": 4, "segment_len": 1}
    spec = parse_spec({**_spec(trees=[tree]), "limits": {"max_paths": 20_000_000, "max_tokens": 10**9}})
    assert spec.limits.max_paths == 20_000_000


def _cell(**fields) -> Cell:
    base = dict(spec="t", model=ModelSpec(**MODEL), prefix_len=8, suffix_len=4, n=2, device="cpu")
    return Cell(**{**base, **fields})


def test_the_memory_floor_counts_the_masks():
    """P = S = 10**6 passed the preflight (6M parameters) and died later: PrefixFlow's suffix rows over a
    10**6-token prefix need a [1, S, P + S] mask."""
    model = ModelSpec(name="llama3:debugmodel", overrides={"max_seq_len": 2_000_000})
    cell = _cell(model=model, prefix_len=10**6, suffix_len=10**6, n=1)
    assert masks_need(cell, 1) >= 10**6 * 2 * 10**6
    assert cell_need(cell, meta_shape(model.name, model.overrides)) >= masks_need(cell, 1)
    with pytest.raises(MemoryRefusal, match="needs at least"):
        preflight_cell(cell, budget=64 << 30)
    packed = _cell(prefix_len=4, suffix_len=2, n=50_000, layout="packed", systems=("baseline",))
    assert masks_need(packed, 50_000) >= (6 * 50_000) ** 2  # one packed sequence of every path


def _row(n: int, first: int = 0, ancestors=()) -> Row:
    cols = torch.arange(n - 1)
    return Row(0, torch.zeros(n, dtype=torch.long), first, tuple(ancestors), cols, cols + 1, cols)


def test_no_mask_where_plain_causal_attention_is_exact():
    """One 20,000-token path, padded: a [20k, 20k] mask (400 MB) was built and then dropped. (Packed keeps its
    mask, which the preflight counts: 3 T x T + T x T bytes.)"""
    mb = lay_out([_row(20_000)], [], [], "padded", torch.device("cpu"))
    assert mb.mask is None
    assert mask_bytes([20_000], 0, "padded", full_sequences=True) == 0
    assert mask_bytes([20_000], 0, "packed", full_sequences=True) == 4 * 20_000**2


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_mask_bytes_bounds_the_masks_built(layout):
    rows = [_row(5, 3, ancestors=(0,)), _row(7, 3, ancestors=(0,)), _row(2, 3, ancestors=(0,))]
    mb = lay_out(rows, [0], [3], layout, torch.device("cpu"))
    assert 0 < mb.mask.numel() <= mask_bytes([5, 7, 2], 3, layout)


@pytest.mark.parametrize(
    "change, text",
    [
        ({"executor": {"nodes": "2"}}, r"executor.nodes: Input should be a valid integer \(got '2'\)"),
        ({"executor": {"max_jobs": 2.0}}, r"executor.max_jobs: Input should be a valid integer"),
        (
            {"axes": {"models": [MODEL], "trees": [{"kind": "agentic", "turns": 2, "branch_at": [0, 5]}]}},
            r"axes.trees.0.agentic: branch_at \[5\] names turns beyond the 2 turns",
        ),
        (
            {"axes": {"models": [MODEL], "trees": [{"kind": "search", "depth": "3"}]}},
            r"axes.trees.0.search.depth: Input should be a valid integer",
        ),
    ],
)
def test_no_loose_coercion(change, text):
    """Issue 36.12: numbers are taken as written; branch points name existing turns."""
    with pytest.raises(SpecError, match=text):
        parse_spec({**_spec(n=[2], lengths=[{"prefix": 4, "suffix": 2}]), **change})
