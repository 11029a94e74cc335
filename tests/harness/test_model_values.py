"""Issue 26, defects 3 and 4: model values that gave tracebacks, or passed validation and then failed inside
the cell, are refused in one line naming the field and the fix, before any model is built."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.cli.common import parse_overrides
from harness.spec.checks import hf_model_config
from prefixflow.model.models import check_model

runner = CliRunner()
SMALL = ["--prefix-len", "8", "--suffix-len", "4", "--n", "2", "--warmup", "0", "--repeats", "1"]
TINY = ["--override", "dim=32", "--override", "n_heads=2", "--override", "n_layers=2"]


@pytest.fixture
def no_build(monkeypatch):
    import harness.run.setup as setup

    def built(*a, **k):
        raise AssertionError("a model was built before the check")

    monkeypatch.setattr(setup, "build_cell_model", built)


def refused(args: list[str], *needles: str) -> str:
    res = runner.invoke(app, ["run", *args, *SMALL], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.output.startswith("error:"), res.output
    out = " ".join(res.output.split())
    for n in needles:
        assert n in out, out
    return out


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("rms_norm_eps=1", ("rms_norm_eps=1", "expected float, got int", "1.0 for a float")),
        ("vocab_size=1.5", ("vocab_size=1.5", "expected int, got float")),
        ("tie_word_embeddings=yes", ("tie_word_embeddings='yes'", "expected bool")),
        ("attention_dropout=0.5", ("attention_dropout=0.5", "dropout", "attention_dropout=0.0")),
        ("hidden_act=evil", ("hidden_act='evil'", "silu")),
        ("rms_norm_eps=-1.0", ("rms_norm_eps=-1.0", "finite number > 0")),
    ],
)
def test_hf_override_values_are_one_line_errors(no_build, override, needles):
    """transformers' strict dataclass raises StrictDataclassFieldValidationError (not a ValueError) for a
    wrongly typed override; dropout, an unknown activation and a non-positive epsilon passed and failed (or
    silently broke exactness) inside the cell."""
    refused(["--model", "hf:llama-tiny", "--override", override], "--model/--override", *needles)


def test_mistral_sliding_window_zero_is_refused(no_build):
    refused(["--model", "hf:mistral-tiny", "--override", "sliding_window=0"], "sliding_window=0", ">= 1")


def test_deeply_nested_config_json_is_a_one_line_error(no_build, tmp_path):
    """json.loads raised RecursionError, which nothing caught."""
    deep = tmp_path / "config.json"
    deep.write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(["--model", f"hf:{deep}"], "nests too deeply")
    with pytest.raises(ValueError, match="nests too deeply"):
        hf_model_config(str(tmp_path))


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rope_theta=-1", "rope_theta=-1 must be a finite number > 0"),
        ("norm_eps=-1", "norm_eps=-1 must be a finite number > 0"),
        ("norm_eps=0", "norm_eps=0 must be a finite number > 0"),
        ("multiple_of=0", "multiple_of=0 must be >= 1"),
    ],
)
def test_torchtitan_values_that_failed_inside_the_cell(no_build, override, needle):
    """rope_theta/norm_eps <= 0 ended in a NonFiniteError blaming the advantages; multiple_of=0 in a
    ZeroDivisionError inside the model."""
    refused(["--model", "llama3:debugmodel", *TINY, "--override", override], needle)
    with pytest.raises(ValueError, match=needle):
        check_model("llama3:debugmodel", parse_overrides([override]))


def test_sequences_beyond_max_seq_len_are_refused_before_the_cell(no_build):
    """max_seq_len=4 with P+S=12 failed in the cell's first step."""
    refused(
        ["--model", "llama3:debugmodel", *TINY, "--override", "max_seq_len=4"],
        "is 12 tokens, more than the model's max_seq_len=4",
        "override max_seq_len=12",
    )
    refused(
        ["--model", "hf:llama-tiny", "--override", "max_position_embeddings=4"],
        "max_position_embeddings=4",
    )


def test_every_builtin_hf_config_and_titan_flavor_still_passes():
    from prefixflow.integrations.hf import HF_MODELS
    from prefixflow.model.models import list_models

    for name in HF_MODELS:
        hf_model_config(name)
    for name in list_models():
        check_model(name)


SPEC = """
name: short
systems: [baseline, prefixflow]
axes:
  models:
    - {name: "llama3:debugmodel", overrides: {dim: 32, n_layers: 2, n_heads: 2, vocab_size: 128, max_seq_len: 8}}
  prefix_ratio: [0.5]
  total_len: [16]
  n: [2]
"""


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_sweep_whose_cells_exceed_max_seq_len_is_refused_at_load(tmp_path, dry_run):
    """max_seq_len=8 with P+S=16: each cell failed in its first step; now the sweep refuses before any."""
    spec = tmp_path / "short.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "out"
    args = ["sweep", str(spec), "--out", str(out), "--executor", "debug", *(["--dry-run"] if dry_run else [])]
    res = runner.invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "is 16 tokens, more than the model's max_seq_len=8" in " ".join(res.output.split()), res.output
    assert not out.exists()
