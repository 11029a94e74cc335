"""Spec loading, validation messages, presets, expansion and cell ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import REPO

from harness.spec.cell import Cell, ModelSpec, Parallel
from harness.spec.load import SpecError, expand, load_spec, parse_spec, safe_name

SMOKE = REPO / "experiments" / "smoke.yaml"


def _spec(**over):
    raw = {
        "name": "t",
        "axes": {
            "models": [{"name": "llama3:debugmodel", "overrides": {"dim": 32}}],
            "n": [2],
            "lengths": [{"prefix": 8, "suffix": 4}],
        },
    }
    raw.update(over)
    return raw


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return p


def test_smoke_spec_expands_to_both_layouts_and_systems():
    spec = load_spec(SMOKE)
    cells = expand(spec)
    assert 2 <= len(cells) <= 8
    assert {c.layout for c in cells} == {"padded", "packed"}
    assert set(spec.systems) == {"baseline", "prefixflow"}
    assert len({c.cell_id for c in cells}) == len(cells)
    assert all(c.world_size == 1 for c in cells)
    assert all(c.prefix_len + c.suffix_len == 64 for c in cells)


def test_paper_preset_overrides_axes():
    cpu, paper = load_spec(SMOKE, "cpu"), load_spec(SMOKE, "paper")
    assert paper.axes.total_len == [12288] and cpu.axes.total_len == [64]
    assert paper.executor.gpus_per_node == 1
    assert {c.cell_id for c in expand(cpu)}.isdisjoint({c.cell_id for c in expand(paper)})


def test_ratio_form_lengths():
    spec = parse_spec(
        _spec(
            axes={
                "models": [{"name": "llama3:debugmodel"}],
                "n": [2, 4],
                "prefix_ratio": [0.25, 0.75],
                "total_len": [64],
            }
        )
    )
    pairs = sorted({(c.prefix_len, c.suffix_len) for c in expand(spec)})
    assert pairs == [(16, 48), (48, 16)]
    assert len(expand(spec)) == 4


def test_unknown_key_names_file_and_field(tmp_path):
    p = _write(
        tmp_path,
        "name: t\naxes:\n  models: [{name: 'llama3:debugmodel'}]\n  n: [2]\n"
        "  lengths: [{prefix: 8, suffix: 4}]\n  layuot: [padded]\n",
    )
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert str(p) in str(e.value) and "axes.layuot" in str(e.value) and "unknown key" in str(e.value)


def test_bad_value_lists_allowed_values():
    bad = _spec()
    bad["axes"] = {**bad["axes"], "layout": ["zigzag"]}
    with pytest.raises(SpecError, match=r"axes\.layout\.0.*'padded' or 'packed'"):
        parse_spec(bad, "x.yaml")


@pytest.mark.parametrize(
    "axes_patch, match",
    [
        ({"lengths": None}, "give 'lengths'"),
        ({"prefix_ratio": [0.5], "total_len": [64]}, "not both"),
        ({"n": [0]}, r"axes\.n\.0: .*greater than or equal to 1"),
        ({"microbatch": [0]}, "microbatch"),
        ({"dtype": ["fp16"]}, "'fp32', 'bf16' or 'fp64'"),
        ({"ac": ["always"]}, "selective"),
        ({"parallel": [{"tp": 0}]}, "parallel.0.tp"),
    ],
)
def test_axis_errors(axes_patch, match):
    raw = _spec()
    axes = {**raw["axes"], **axes_patch}
    raw["axes"] = {k: v for k, v in axes.items() if v is not None}
    with pytest.raises(SpecError, match=match):
        parse_spec(raw, "x.yaml")


def test_ratio_that_empties_a_side_is_an_error():
    raw = _spec(axes={"models": [{"name": "a:b"}], "n": [1], "prefix_ratio": [0.99], "total_len": [10]})
    with pytest.raises(SpecError, match="empty prefix or suffix"):
        parse_spec(raw, "x.yaml")


def test_preset_errors_name_the_preset_and_unknown_presets_are_rejected():
    with pytest.raises(SpecError, match=r"preset 'paper'.*\n.*axes\.n"):
        parse_spec(_spec(presets={"paper": {"axes": {"n": [-1]}}}), "x.yaml")
    with pytest.raises(SpecError, match="'cpu', 'paper' or 'smoke'"):
        parse_spec(_spec(presets={"gpu": {}}), "x.yaml")
    with pytest.raises(SpecError, match="unknown preset"):
        parse_spec(_spec(), "x.yaml", preset="laptop")


def test_names_are_safe():
    with pytest.raises(SpecError, match="name"):
        parse_spec(_spec(name="../../etc"), "x.yaml")
    with pytest.raises(SpecError, match="systems"):
        parse_spec(_spec(systems=["base;rm -rf /"]), "x.yaml")
    with pytest.raises(SpecError, match="override key"):
        parse_spec(_spec(axes={**_spec()["axes"], "models": [{"name": "a:b", "overrides": {"a b": 1}}]}), "x")
    for raw in ("../../etc/passwd", "..", ".hidden", "a/b\\c", "", "-rf"):
        out = safe_name(raw)
        assert out and "/" not in out and "\\" not in out and not out.startswith((".", "-"))


def test_yaml_is_loaded_safely(tmp_path):
    p = _write(tmp_path, "name: !!python/object/apply:os.system ['echo pwned']\naxes: {}\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(p)
    with pytest.raises(SpecError, match="mapping"):
        load_spec(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")


def test_cell_id_is_a_hash_of_the_measured_config():
    m = ModelSpec(name="llama3:debugmodel", overrides={"dim": 32})
    a = Cell(spec="s", model=m, prefix_len=8, suffix_len=4, n=2)
    assert a.cell_id == Cell(spec="other", model=m, prefix_len=8, suffix_len=4, n=2, timeout_min=1).cell_id
    assert a.cell_id != Cell(spec="s", model=m, prefix_len=8, suffix_len=4, n=3).cell_id
    assert a.cell_id != Cell(spec="s", model=m, prefix_len=8, suffix_len=4, n=2, layout="packed").cell_id
    assert len(a.cell_id) == 12 and safe_name(a.cell_id) == a.cell_id
    assert (
        Cell(
            spec="s", model=m, prefix_len=8, suffix_len=4, n=2, parallel=Parallel(tp=2, cp=2, pp=2)
        ).world_size
        == 8
    )


def test_duplicate_axis_values_do_not_duplicate_cells():
    raw = _spec()
    raw["axes"] = {**raw["axes"], "n": [2, 2]}
    assert len(expand(parse_spec(raw))) == 1


SWEEP_SPECS = sorted(p for p in SMOKE.parent.glob("*.yaml") if p.stem != "claim2")  # claim2: pf-bench rl


@pytest.mark.parametrize("path", SWEEP_SPECS, ids=lambda p: p.stem)
def test_every_committed_spec_loads_under_every_preset(path):
    """A spec in experiments/ that no longer validates (e.g. after a field is renamed) fails here, not on the
    cluster: parse_spec checks every preset, and each preset expands into cells."""
    for preset in ("cpu", "paper"):
        spec = load_spec(path, preset=preset)
        assert expand(spec), f"{path.name} --preset {preset} has no cells"


def test_offload_under_pipeline_parallelism_is_refused_before_anything_runs():
    from harness.spec.cell import Cell, ModelSpec, Parallel

    with pytest.raises(ValueError, match=r"offload: PrefixFlow's offload does not run under pipeline parallelism"):
        Cell(spec="t", model=ModelSpec(name="llama3:debugmodel"), prefix_len=8, suffix_len=8, n=2, offload=True,
             parallel=Parallel(pp=2), systems=("prefixflow",))  # fmt: skip
