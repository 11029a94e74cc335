"""pf-bench on vision-language prompts (issue 32): the hf: Qwen2.5-VL entries, the chart-QA and video shapes, a
vision cell through the one measurement loop, and the cost model against what runs.

The cost model (``harness.costmodel.vision`` on top of the text model) must equal the counters exactly, kind
by kind: FlopCounterMode's mm/addmm (every linear layer, the tower's included), the SDPA pairs (the tower's
window and full-frame calls, the language model's), and the tower's patch-embedding convolution; for both
systems, padded and packed, microbatch 1, 2 and all, the tower trained and frozen, an image and a video whose
grid does not divide into whole windows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")

from support.vlm import VERIFIED_TRANSFORMERS  # noqa: E402

import prefixflow as pf  # noqa: E402
from harness.costmodel.counting import count_flops  # noqa: E402
from harness.costmodel.flops import as_shape, executed_flops, ideal_speedup  # noqa: E402
from harness.costmodel.vision import tower_flops, vision_shape  # noqa: E402
from harness.spec.cell import Cell  # noqa: E402
from harness.vision_workloads import ChartQAShape, VideoShape  # noqa: E402
from harness.vlm_models import build_vlm_model, freeze_tower, vlm_config  # noqa: E402

pytestmark = VERIFIED_TRANSFORMERS

CHART = ChartQAShape(image_tokens=(6, 10), system_len=3, question_len=4, answer_min=2, answer_max=9, seed=1)
VIDEO = VideoShape(frames=4, frame_tokens=(5, 6), question_len=3, answer_min=3, answer_max=7, seed=2)
RUNS = [  # (system, layout, microbatch)
    ("baseline", "padded", None),
    ("baseline", "packed", 2),
    ("prefixflow", "padded", 1),
    ("prefixflow", "packed", 2),
    ("prefixflow", "packed", None),
]


def _model(tower: str):
    model = build_vlm_model("qwen2_5_vl-tiny", seed=0)
    if tower == "frozen":
        freeze_tower(model)
    return pf.apply_prefixflow(model)


@pytest.mark.parametrize("tower", ["trained", "frozen"])
@pytest.mark.parametrize("workload", [CHART, VIDEO], ids=["chart_qa", "video"])
def test_cost_model_equals_what_runs(workload, tower):
    model = _model(tower)
    group = workload.group(model, 3, torch.float32)
    grids = workload.grids(model.config.vision_config.spatial_merge_size)
    shape = vision_shape(as_shape(model.config.text_config), model.config, grids, tower == "trained")
    assert tower_flops(shape.tower, grids, shape.trained).total > 0
    for system, layout, mb in RUNS:
        counted, stats = count_flops(
            lambda s=system, la=layout, m=mb: pf.train_group(model, group, system=s, layout=la, microbatch=m)
        )
        model.zero_grad(set_to_none=True)
        modelled = executed_flops(
            system, shape, group.prompt_len, group.response_lens, layout=layout, microbatch=mb
        )
        assert modelled == counted, (system, layout, mb, modelled, counted)
        assert stats.vision_runs == (1 if system == "prefixflow" else group.n)
    # the baseline pays the tower N times, PrefixFlow once: the ideal lies between the text's and N
    text_only = ideal_speedup(shape.text, group.prompt_len, group.response_lens)
    ideal = ideal_speedup(shape, group.prompt_len, group.response_lens)
    assert min(text_only, group.n) < ideal < max(text_only, group.n)


def test_workload_grids_and_inputs():
    model = build_vlm_model("qwen2_5_vl-tiny")
    chart = CHART.group(model, 2, torch.float64)
    assert chart.prompt_len == CHART.prompt_len == 3 + 2 + 60 + 4
    assert chart.prompt_inputs["image_grid_thw"].tolist() == [[1, 12, 20]]
    assert chart.prompt_inputs["pixel_values"].shape == (240, 3 * 2 * 14 * 14)
    assert chart.prompt_inputs["pixel_values"].dtype == torch.float64
    assert int((chart.prompt == model.config.image_token_id).sum()) == 60
    video = VIDEO.group(model, 3, torch.float32)
    assert video.prompt_inputs["video_grid_thw"].tolist() == [[2, 10, 12]]
    assert int(video.prompt_inputs["mm_token_type_ids"].eq(2).sum()) == VIDEO.visual_tokens == 60
    assert all(VIDEO.answer_min <= n <= VIDEO.answer_max for n in video.response_lens)
    assert torch.equal(VIDEO.group(model, 3, torch.float32).prompt, video.prompt)  # seeded
    assert abs(VideoShape().prefix_ratio - 0.980) < 1e-3  # the default video shape: the paper's 98%
    from harness.run.memory import pixels_need

    P, S = VIDEO.nominal()
    cell = Cell(spec="t", model={"name": "hf:qwen2_5_vl-tiny"}, prefix_len=P, suffix_len=S, n=3, vision=VIDEO)
    pixels = video.prompt_inputs["pixel_values_videos"]
    assert pixels_need(cell) == pixels.numel() * pixels.element_size()  # the memory preflight counts them


def test_vision_cell_records(tmp_path):
    """A vision cell through pf-bench's loop: both systems ok, equal losses, the tower's runs counted, the
    modelled FLOPs equal to the counted ones, the workload in the record."""
    from harness.run.measurement import measure_cell

    P, S = VIDEO.nominal()
    cell = Cell(spec="t", model={"name": "hf:qwen2_5_vl-tiny"}, prefix_len=P, suffix_len=S, n=3, vision=VIDEO,
                tower="frozen", layout="packed", microbatch=1, device="cpu", warmup=0, repeats=1)  # fmt: skip
    base, ours = measure_cell(cell)
    assert base["status"] == ours["status"] == "ok", (base.get("error"), ours.get("error"))
    assert abs(base["loss"] - ours["loss"]) <= 1e-5 * abs(base["loss"])
    assert (base["vision_runs"], ours["vision_runs"]) == (3, 1)
    for rec in (base, ours):
        assert rec["counted_flops"] == rec["model_flops"] > 0
        assert rec["vision_workload"] == "video" and rec["tower"] == "frozen" and rec["visual_tokens"] == 60
        assert json.loads(rec["vision_params"])["frames"] == 4
    assert base["model_vision_flops"] == 3 * ours["model_vision_flops"] > 0


def test_spec_expands_and_records_cover_it():
    """experiments/multimodal.yaml: 14 cells; every committed record's modelled FLOPs equal its counted ones."""
    from harness.spec.load import expand, load_spec

    root = Path(__file__).resolve().parents[2]
    cells = expand(load_spec(root / "experiments/multimodal.yaml"))
    assert len(cells) == 13 and {c.tower for c in cells} == {"trained", "frozen"}
    assert {c.vision.kind for c in cells} == {"chart_qa", "video"} and {c.n for c in cells} == {4, 8, 16}
    files = sorted((root / "results/multimodal").glob("*.parquet"))
    if not files:
        pytest.skip("results/multimodal/ is not recorded")
    import pandas as pd

    df = pd.concat([pd.read_parquet(f) for f in files])
    assert set(df["cell_id"]) == {c.cell_id for c in cells}
    ok = df[df["status"] == "ok"]
    assert len(ok) == 2 * len(cells)
    assert (ok["counted_flops"] == ok["model_flops"]).all()


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"kind": "video", "frames": 15}, "frames 15 is not a multiple of 2"),
        ({"kind": "video", "frames": 5000}, "frames"),
        ({"kind": "chart_qa", "image_tokens": [600, 4]}, "image_tokens"),
        ({"kind": "video", "frames": 64, "frame_tokens": [128, 128]}, "524,288 visual tokens per prompt"),
        ({"kind": "chart_qa", "answer_min": 40, "answer_max": 30}, "answer_min 40 > answer_max 30"),
        ({"kind": "chart_qa", "pixels": 3}, "pixels"),
    ],
)
def test_hostile_vision_shapes(tmp_path, fields, message):
    from harness.spec.load import SpecError, load_spec

    spec = tmp_path / "s.yaml"
    shape = json.dumps(fields)
    spec.write_text(
        f"name: v\naxes:\n  models: [{{name: 'hf:qwen2_5_vl-tiny'}}]\n  vision: [{shape}]\n  n: [2]\n"
    )
    with pytest.raises(SpecError, match="vision") as err:
        load_spec(spec)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "axes,message",
    [
        ("models: [{name: 'llama3:debugmodel'}]\n  vision: [{kind: video}]\n  n: [2]", "needs an hf: vision-language"),
        ("models: [{name: 'hf:qwen2_5_vl-tiny'}]\n  vision: [{kind: video}]\n  n: [2]\n  total_len: [64]",
         "'vision' sets the prompt"),
        ("models: [{name: 'hf:llama-tiny'}]\n  lengths: [{prefix: 8, suffix: 8}]\n  n: [2]\n  tower: [frozen]",
         "'tower' applies to vision cells only"),
        ("models: [{name: 'hf:qwen2_5_vl-tiny'}]\n  vision: [{kind: video}]\n  n: [2]\n  tower: [thawed]", "tower"),
    ],
)  # fmt: skip
def test_hostile_vision_axes(tmp_path, axes, message):
    from harness.spec.load import SpecError, expand, load_spec

    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: v\naxes:\n  {axes}\n")
    with pytest.raises(SpecError) as err:
        expand(load_spec(spec))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"vision_depht": 2}, "unknown override field 'vision_depht'"),
        ({"vision_hidden_size": 36}, "vision_hidden_size=36 must be a multiple of 4"),
        (
            {"vision_fullatt_block_indexes": 5},
            "override vision_fullatt_block_indexes=5 of hf:qwen2_5_vl-tiny",
        ),
        ({"vision_depth": 1}, "vision_fullatt_block_indexes [1] are outside the 1 blocks"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be an integer >= 1"),
    ],
)
def test_vlm_overrides(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        vlm_config("qwen2_5_vl-tiny", overrides)
    assert vlm_config("qwen2_5_vl-tiny", {"vision_depth": 3}).vision_config.depth == 3


def _records():
    rows = []
    for kind, ratio in (("chart_qa", 0.88), ("video", 0.985)):
        for tower in ("trained", "frozen"):
            for n in (4, 8, 16):
                for off in (False, True) if kind == "video" and n == 16 else (False,):
                    cid = f"{kind}-{tower}-{n}-{off}"
                    common = dict(cell_id=cid, status="ok", vision_workload=kind, tower=tower, n=n, offload=off,
                                  vision_prefix_ratio=ratio, visual_tokens=1024, git_rev="abc")  # fmt: skip
                    rows.append(dict(common, system="baseline", step_time_s=1.0 * n, counted_flops=10.0 * n,
                                     peak_mem_phase_b_bytes=100.0, vision_runs=n, offload=False))  # fmt: skip
                    rows.append(dict(common, system="prefixflow", step_time_s=2.0, counted_flops=20.0,
                                     peak_mem_phase_b_bytes=20.0 if off else 80.0, vision_runs=1))  # fmt: skip
    return pd.DataFrame(rows)


def test_figure_and_summary(tmp_path):
    """The figure is a function of the table; the summary pairs each PrefixFlow row with its cell's baseline."""
    from harness.figures import render_all
    from harness.figures.common import measured
    from harness.figures.multimodal import vision_summary

    df = _records()
    summary = vision_summary(df)
    assert len(summary) == 14
    row = summary[
        (summary["vision_workload"] == "video") & summary["offload"] & (summary["tower"] == "trained")
    ]
    assert (
        row["speedup"].item() == 8.0
        and row["flop_ideal"].item() == 8.0
        and row["phase_b_ratio"].item() == 0.2
    )
    assert measured(df).empty  # vision cells stay out of the text figures
    made = render_all(df, tmp_path, only=["multimodal"])
    assert [p.name for p in made] == ["multimodal.png"] and made[0].stat().st_size > 10_000
    from harness.figures import render_tables

    tables = {p.name for p in render_tables(df, tmp_path)}
    assert {"multimodal.md", "multimodal.tex"} <= tables
