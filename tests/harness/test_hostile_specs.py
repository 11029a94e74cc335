"""Hostile and careless specs and command lines (issue 14, breaks 4, 5, 7 and 8): bounded work, user text
shown as text, and one-line errors naming the field before any work, never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO
from typer.testing import CliRunner

import harness.execute.local
from harness.cli import app
from harness.records import write_records
from harness.spec.load import SpecError, load_spec

runner = CliRunner()
MODEL = "{name: 'llama3:debugmodel', overrides: {dim: 32, n_layers: 1, n_heads: 2, vocab_size: 64}}"
TINY = f"""name: tiny
warmup: 0
repeats: 1
systems: [baseline]
axes:
  models: [{MODEL}]
  lengths: [{{prefix: 6, suffix: 3}}]
  n: [2]
"""
RUN = ["run", "--model", "llama3:debugmodel", "--prefix-len", "6", "--suffix-len", "3", "--n", "2"]
RUN += ["--override", "dim=32", "--override", "n_layers=1", "--override", "n_heads=2"]
RUN += ["--override", "vocab_size=64", "--warmup", "0", "--repeats", "1", "--systems", "baseline"]


def cli(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


def user_error(res, *fragments: str, code: int = 2) -> str:
    """The command failed with ``code`` and a message holding ``fragments``, without a traceback."""
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output, res.output
    for fragment in fragments:
        assert fragment in res.output, f"{fragment!r} not in {res.output!r}"
    return res.output


def spec_file(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- break 4: bounded work ------------------------------------------------------------------------------


def test_alias_bomb_is_refused_quickly(tmp_path):
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    bomb += [f"{c}: &{c} [{', '.join(['*' + p] * 10)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    path = spec_file(tmp_path, "\n".join(bomb) + "\nname: *i\n")  # 10**9 nodes once expanded
    start = time.perf_counter()
    with pytest.raises(SpecError, match=r"expands to more than 100,000 nodes through its aliases"):
        load_spec(path)
    assert time.perf_counter() - start < 5
    # variants: a recursive alias, a huge file, deep nesting
    with pytest.raises(SpecError, match="recursive"):
        load_spec(spec_file(tmp_path, "a: &a [1, *a]\n"))
    with pytest.raises(SpecError, match="larger than 1,048,576 bytes"):
        load_spec(spec_file(tmp_path, "# " + "x" * (1 << 20) + "\n"))
    with pytest.raises(SpecError, match="nested too deeply|not valid YAML"):
        load_spec(spec_file(tmp_path, "[" * 100_000 + "]" * 100_000))


def test_error_messages_show_truncated_input(tmp_path):
    text = TINY.replace("n: [2]", "n: " + str(list(range(5000))).replace("0,", "'zero',", 1))
    with pytest.raises(SpecError) as err:
        load_spec(spec_file(tmp_path, text.replace("name: tiny", "name: '" + "x" * 10_000 + "'")))
    assert len(str(err.value)) < 2_000 and "..." in str(err.value)


def test_cell_count_is_capped_and_the_cap_is_raised_explicitly(tmp_path):
    text = TINY.replace("  lengths: [{prefix: 6, suffix: 3}]\n", "")
    text = text.replace(
        "n: [2]",
        f"n: {list(range(1, 2001))}\n  total_len: [1000]\n  prefix_ratio: {[i / 1000 for i in range(1, 1000)]}",
    )
    path = spec_file(tmp_path, text)
    start = time.perf_counter()
    for extra in ([], ["--dry-run"]):
        user_error(
            cli("sweep", path, "--out", tmp_path / "out", *extra),
            "expands to 1,998,000 cells",
            "--max-cells 1998000",
        )
    assert time.perf_counter() - start < 30 and not (tmp_path / "out").exists()
    small = spec_file(tmp_path, TINY.replace("n: [2]", "n: [1, 2, 3]"), "small.yaml")
    user_error(cli("sweep", small, "--dry-run", "--max-cells", "2", "--out", tmp_path), "expands to 3 cells")
    res = cli("sweep", small, "--dry-run", "--max-cells", "3", "--out", tmp_path)
    assert res.exit_code == 0 and "3 to run" in res.output


# ---- break 5: user text is data ---------------------------------------------------------------------------


def test_markup_in_spec_keys_and_values_prints_as_text(tmp_path):
    out = user_error(
        cli("sweep", spec_file(tmp_path, TINY + "'[/foo]': 1\n"), "--dry-run"), "[/foo]", "unknown key"
    )
    assert "MarkupError" not in out
    out = user_error(
        cli("sweep", spec_file(tmp_path, TINY.replace("name: tiny", "name: '[/foo]'"))), "[/foo]"
    )
    assert "^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$" in out  # the pattern prints intact
    out = user_error(cli("sweep", spec_file(tmp_path, TINY.replace("[baseline]", "['[bold]X']"))), "[bold]X")
    assert "^[a-z][a-z0-9_]*$" in out
    out = user_error(cli("sweep", spec_file(tmp_path, TINY.replace("n: [2]", "n: [.nan]"))), "axes.n.0")
    assert "(got nan)" in out


def test_records_holding_markup_do_not_break_status_or_collect(tmp_path):
    rec = {"cell_id": "c1", "spec": "[/foo]", "system": "[bold]sys", "status": "ok", "timestamp": "t"}
    write_records(tmp_path / "s" / "c1.parquet", [rec])
    res = cli("status", tmp_path)
    assert res.exit_code == 0 and "[/foo]" in res.output, res.output
    res = cli("collect", tmp_path, "-o", tmp_path.parent / f"{tmp_path.name}-all.parquet")
    assert res.exit_code == 0, res.output
    res = cli("run", "--model", "[/x]:y", "--prefix-len", "6", "--suffix-len", "3", "--n", "2")
    user_error(res, "--model: String should match", "^([A-Za-z0-9_.-]+:[A-Za-z0-9_.-]+|hf:")


# ---- break 7: one-line errors before any work -------------------------------------------------------------


def test_unreadable_specs_are_one_line_errors(tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: t\n\xff\xfe\x00\x01")
    user_error(cli("sweep", binary, "--dry-run"), "not UTF-8 text (byte 0xff at offset 8)")
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"name: t\x00\n")
    user_error(cli("sweep", nul, "--dry-run"), "not valid YAML")
    user_error(cli("sweep", tmp_path, "--dry-run"), "cannot read spec (Is a directory)")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    user_error(cli("sweep", fifo, "--dry-run"))  # does not block


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"repeats: 1": "repeats: 1\nseed: 100000000000000000000000"}, "seed"),
        ({"repeats: 1": "repeats: 1\nseed: 1.0e+23"}, "seed"),
        ({"repeats: 1": "repeats: 1\nseed: 1e23"}, "seed"),
        ({"repeats: 1": "repeats: 1\nseed: -1"}, "seed"),
        ({"repeats: 1": "repeats: 1\nexecutor: {timeout_min: .inf}"}, "executor.timeout_min"),
        ({"repeats: 1": "repeats: 1\nexecutor: {mem_gb: .nan}"}, "executor.mem_gb"),
        ({"n: [2]": "n: [100000000000000000000]"}, "axes.n.0"),
        ({"vocab_size: 64": "vocab_size: 0"}, "vocab_size=0 must be >= 1"),
        ({"n_heads: 2": "n_heads: 3, n_kv_heads: 2"}, "n_heads=3 must be a multiple of n_kv_heads=2"),
        ({"dim: 32": "dim: 32, bogus: 1"}, "unknown override field(s) ['bogus']"),
        ({"[baseline]": "[baseline, bogus_system]"}, "unknown system 'bogus_system'"),
    ],
)
def test_bad_values_fail_at_load_and_in_dry_run(tmp_path, patch, field):
    text = TINY
    for old, new in patch.items():
        text = text.replace(old, new)
    path = spec_file(tmp_path, text)
    with pytest.raises(SpecError, match=None) as err:
        load_spec(path)
    assert field in str(err.value)
    for extra in (["--dry-run"], ["--executor", "slurm"]):
        user_error(cli("sweep", path, "--out", tmp_path / "out", *extra), field)
    assert not (tmp_path / "out").exists()  # before any work


def test_duplicate_keys_are_an_error(tmp_path):
    with pytest.raises(SpecError, match=r"duplicate key 'repeats' \(first given on line 3\)"):
        load_spec(spec_file(tmp_path, TINY + "repeats: 5\n"))
    with pytest.raises(SpecError, match="duplicate key 'dim'"):
        load_spec(spec_file(tmp_path, TINY.replace("dim: 32", "dim: 32, dim: 64")))
    merged = TINY.replace("axes:", "base: &b {prefix: 6, suffix: 3}\naxes:").replace(
        "lengths: [{prefix: 6, suffix: 3}]", "lengths: [{<<: *b, suffix: 4}]"
    )
    with pytest.raises(SpecError, match="base: unknown key"):  # a merge may still override its keys
        load_spec(spec_file(tmp_path, merged))


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--override", "bogus=1"], ["--model/--override", "unknown override field(s) ['bogus']"]),
        (["--override", "n_heads=3", "--override", "n_kv_heads=2"], ["n_heads=3 must be a multiple"]),
        (["--override", "vocab_size=0"], ["vocab_size=0 must be >= 1"]),
        (["--override", "dim=nan"], ["--override.dim: Input should be a finite number"]),
        (["--microbatch", "0"], ["--microbatch", "greater than or equal to 1"]),
        (["--seed", "100000000000000000000000"], ["--seed", "less than or equal to 4294967295"]),
        (["--seed", "1e23"], ["Invalid value for '--seed'"]),
        (["--systems", ""], ["--systems", "at least 1 item"]),
        (["--systems", ",,"], ["--systems", "at least 1 item"]),
        (["--systems", "baseline,nope"], ["--systems: unknown system 'nope'"]),
        (["--device", "tpu"], ["--device"]),
        (["--repeats", "0"], ["--repeats"]),
    ],
)
def test_run_rejects_bad_options_before_running(monkeypatch, args, fragments):
    monkeypatch.setattr(harness.execute.local, "run_cell", lambda *a, **k: pytest.fail("the cell ran"))
    user_error(cli(*RUN, *args), *fragments)


def test_run_checks_out_before_the_cell_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(harness.execute.local, "run_cell", lambda *a, **k: pytest.fail("the cell ran"))
    afile = tmp_path / "file"
    afile.write_text("x")
    user_error(cli(*RUN, "--out", afile), f"--out {afile}", "not a directory")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "adhoc").write_text("x")  # the record folder is a file
    user_error(cli(*RUN, "--out", tmp_path / "o"), "--out")
    (tmp_path / "p").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "p" / "adhoc")  # a link planted as the record folder
    user_error(cli(*RUN, "--out", tmp_path / "p"), "symbolic link")
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root for a read-only mount"
)
def test_run_into_a_read_only_folder_fails_before_the_cell_runs(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = " ".join(
        f"'{a}'" for a in [sys.executable, "-m", "harness.cli", *RUN, "--repeats", "1000000", "--out", ro]
    )
    res = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs -o ro tmpfs '{ro}' && exec {cmd}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        },
        cwd=REPO,
    )
    assert res.returncode == 2, (
        res.stdout + res.stderr
    )  # a million repeats would not finish: it never started
    assert f"--out {ro}: Read-only file system" in res.stderr and "Traceback" not in res.stderr


def test_sweep_into_a_file_fails_before_any_work(tmp_path):
    afile = tmp_path / "results"
    afile.write_text("x")
    user_error(cli("sweep", spec_file(tmp_path, TINY), "--out", afile), f"--out {afile}")


# ---- break 8: failures are reported -----------------------------------------------------------------------


@pytest.mark.slow
def test_sweep_exits_non_zero_when_cells_fail_and_says_so(tmp_path):
    spec = spec_file(tmp_path, TINY + "executor: {timeout_min: 0.0001}\n")  # killed at 6 ms: a timeout
    res = cli("sweep", spec, "--out", tmp_path / "out")
    out = user_error(res, "1 of 1 cells failed {'timeout': 1}", "--retry-failed", code=1)
    assert "statuses {'timeout': 1}" in out
    res = cli("sweep", spec, "--out", tmp_path / "out")  # a rerun still says so
    user_error(res, "1 of 1 cells failed", code=1)
