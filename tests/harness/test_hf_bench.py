"""pf-bench with Hugging Face models: ``hf:<built-in config | local config.json>`` cells run like TorchTitan ones."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

pytest.importorskip("transformers")

from harness.run.measurement import measure_cell  # noqa: E402
from harness.spec.cell import Cell, ModelSpec
from harness.spec.load import load_spec


def _cell(model: ModelSpec, systems=("baseline", "prefixflow", "prefix_grouper"), **over) -> Cell:
    base = dict(spec="t", model=model, prefix_len=12, suffix_len=4, n=3, warmup=1, repeats=1, systems=systems)
    return Cell(**{**base, **over})


def test_hf_cell_runs_every_system_with_equal_losses():
    cell = _cell(ModelSpec(name="hf:qwen3-tiny", overrides={"num_hidden_layers": 1}), layout="packed")
    records = {r["system"]: r for r in measure_cell(cell)}
    assert {r["status"] for r in records.values()} == {"ok"}, [r["error"] for r in records.values()]
    losses = [r["loss"] for r in records.values()]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    rec = records["prefixflow"]
    assert rec["model"] == "hf:qwen3-tiny" and rec["n_layers"] == 1 and rec["dim"] == 64
    assert rec["head_dim"] == 16 and rec["n_kv_heads"] == 2 and rec["ideal_speedup"] > 1
    assert rec["prefix_tokens"] == 11


def test_local_config_path_and_bad_names(tmp_path):
    from prefixflow.integrations.hf import hf_config

    hf_config("llama-tiny").save_pretrained(tmp_path)
    cell = _cell(ModelSpec(name=f"hf:{tmp_path}"), systems=("baseline", "prefixflow"))
    records = measure_cell(cell)
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert records[0]["loss"] == pytest.approx(records[1]["loss"], rel=1e-5)
    missing = measure_cell(_cell(ModelSpec(name="hf:no-such-config"), systems=("prefixflow",)))
    assert missing[0]["status"] == "error" and "neither a built-in config" in missing[0]["error"]
    for bad in ("hf:", "hf:a b", "hf:$(reboot)", "qwen3"):
        with pytest.raises(ValidationError):
            ModelSpec(name=bad)


def test_hf_spec_loads(tmp_path):
    spec = load_spec("experiments/hf.yaml")
    names = [m.name for block in spec.axes_blocks for m in block.models]
    assert "hf:llama-debug" in names and "llama3:debugmodel" in names
    huge = tmp_path / "config.json"
    huge.write_text(json.dumps({"model_type": "llama", "pad": "x" * (2 << 20)}))
    bad = measure_cell(_cell(ModelSpec(name=f"hf:{tmp_path}"), systems=("prefixflow",)))
    assert bad[0]["status"] == "error" and "larger than" in bad[0]["error"]


@pytest.mark.parametrize(
    ("name", "overrides", "field"),
    [
        ("llama-tiny", {"num_hidden_layers": 0}, "num_hidden_layers=0"),
        ("llama-tiny", {"vocab_size": 0}, "vocab_size=0"),
        ("llama-tiny", {"num_attention_heads": 3}, "num_attention_heads=3"),
        ("qwen3-tiny", {"head_dim": 0}, "head_dim=0"),
    ],
)
def test_bad_hf_config_fields_fail_before_any_weight(name, overrides, field):
    """The HF twin of issue 14's `n_heads=3 / vocab_size=0` attacks: a one-line error naming the field at
    spec load (and dry-run), never a torch traceback from inside the cell."""
    from harness.spec.checks import check_model_spec

    with pytest.raises(ValueError, match=field):
        check_model_spec(ModelSpec(name=f"hf:{name}", overrides=overrides))


def test_unsupported_hf_model_type_fails_at_load(tmp_path):
    from harness.spec.checks import check_model_spec

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert'"):
        check_model_spec(ModelSpec(name=f"hf:{tmp_path}"))
