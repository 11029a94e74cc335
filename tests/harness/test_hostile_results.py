"""A shared results folder as an attacker leaves it (issue 14, breaks 2, 3 and 6): no code from data, no
write through a planted link, and records verified on read; no good record is lost."""

from __future__ import annotations

import json
import os
import pickle
import stat
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_hostile_specs import TINY, cli, spec_file, user_error

from harness.execute.executors import job_path
from harness.records import InvalidRecord, collect, read_records, write_records
from harness.safe_fs import JOBS_DIR_ENV, UnsafePathError, jobs_folder
from harness.spec.load import expand, load_spec
from harness.sweep import plan, spec_folder, status_table


class Plant:
    """Unpickling this creates ``marker``: proof that code ran from data."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Path, Path]:
    """A results folder with one recorded cell of the tiny spec (local executor: real worker process)."""
    base = tmp_path_factory.mktemp("swept")
    spec = spec_file(base, TINY)
    res = cli("sweep", spec, "--out", base / "out")
    assert res.exit_code == 0, res.output
    return spec, base / "out"


def _cell(spec: Path):
    return expand(load_spec(spec))[0]


# ---- break 2: code never comes from data ------------------------------------------------------------------


def test_job_files_and_pickles_live_in_a_private_folder_outside_the_results(swept):
    spec, out = swept
    folder = spec_folder(out, "tiny")
    private = jobs_folder(folder)
    st = os.stat(private)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert not private.is_relative_to(out.resolve()) and job_path(folder, _cell(spec)).parent == private
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("_")) == [
        "_logs",
        "_manifest.json",
        "_sweep.lock",
    ]
    assert not list(out.rglob("*.pkl")) and [p.name for p in out.rglob("*.json")] == ["_manifest.json"]


def test_planted_pickles_and_job_files_in_the_results_folder_are_never_loaded(tmp_path):
    marker = tmp_path / "pwned"
    spec = spec_file(tmp_path, TINY)
    folder = spec_folder(tmp_path / "out", "tiny")
    for sub in ("_slurm", "_jobs", "_logs"):
        (folder / sub).mkdir(parents=True)
        for name in ("0_submitted.pkl", "0_0_result.pkl", "1_result.pkl", f"{_cell(spec).cell_id}.json"):
            (folder / sub / name).write_bytes(pickle.dumps(Plant(marker)))
    res = cli("sweep", spec, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert (
        not marker.exists()
        and read_records(folder / f"{_cell(spec).cell_id}.parquet")["status"].eq("ok").all()
    )


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_job_folder_others_can_write_is_refused(tmp_path, monkeypatch, mode):
    spec = spec_file(tmp_path, TINY)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    folder = spec_folder(tmp_path / "out", "tiny")
    monkeypatch.setenv(JOBS_DIR_ENV, str(jobs))
    private = jobs_folder(folder)  # fine while private
    os.chmod(private, mode)
    user_error(cli("sweep", spec, "--out", tmp_path / "out"), "writable by other users", "refusing")
    os.chmod(private, 0o700)
    os.chmod(jobs, mode)  # an ancestor others may write: they could swap the folder
    user_error(cli("sweep", spec, "--out", tmp_path / "out"), f"{jobs} is writable by other users")
    assert not list((tmp_path / "out").rglob("*.parquet"))


def test_a_job_folder_owned_by_someone_else_or_inside_the_results_is_refused(tmp_path, monkeypatch):
    folder = spec_folder(tmp_path / "out", "tiny")
    monkeypatch.setenv(JOBS_DIR_ENV, str(tmp_path / "out" / "jobs"))
    with pytest.raises(UnsafePathError, match="inside the results folder"):
        jobs_folder(folder)
    theirs = tmp_path / "theirs"
    monkeypatch.setenv(JOBS_DIR_ENV, str(theirs))
    target = Path(os.path.realpath(folder)).name
    private = jobs_folder(folder)
    assert private.name.startswith(target)
    if os.geteuid() == 0:
        os.chown(private, 65534, 65534)
        with pytest.raises(UnsafePathError, match="belongs to uid 65534"):
            jobs_folder(folder)


# ---- break 3: no write follows a link out of --out --------------------------------------------------------


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    return victim


@pytest.mark.parametrize(
    "planted", ["_sweep.lock", "_manifest.json", "._manifest.json.tmp", "{cell}.parquet"]
)
def test_links_planted_as_sweep_files_are_not_written_through(tmp_path, planted):
    spec, victim = spec_file(tmp_path, TINY), _victim(tmp_path)
    folder = spec_folder(tmp_path / "out", "tiny")
    folder.mkdir(parents=True)
    link = folder / planted.format(cell=_cell(spec).cell_id)
    os.symlink(victim, link)
    res = cli("sweep", spec, "--out", tmp_path / "out")
    if planted == "_sweep.lock":
        user_error(res, "refusing to open", "_sweep.lock", "symbolic link")
    else:
        assert res.exit_code == 0, res.output
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("planted", ["_logs/{cell}.out", "_logs/{cell}.err", "hardlink"])
def test_planted_log_files_are_replaced_not_written_through(tmp_path, planted):
    spec, victim = spec_file(tmp_path, TINY), _victim(tmp_path)
    cell = _cell(spec)
    logs = spec_folder(tmp_path / "out", "tiny") / "_logs"
    logs.mkdir(parents=True)
    if planted == "hardlink":
        os.link(victim, logs / f"{cell.cell_id}.out")
    else:
        os.symlink(victim, logs / planted.format(cell=cell.cell_id).removeprefix("_logs/"))
    res = cli("sweep", spec, "--out", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert victim.read_text() == "precious"
    assert not (logs / f"{cell.cell_id}.out").is_symlink()


@pytest.mark.parametrize("planted", ["tiny", "tiny/_logs"])
def test_planted_folder_links_are_refused(tmp_path, planted):
    spec = spec_file(tmp_path, TINY)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out" / "tiny").mkdir(parents=True, exist_ok=True)
    if planted == "tiny":
        (tmp_path / "out" / "tiny").rmdir()
    os.symlink(elsewhere, tmp_path / "out" / planted)
    user_error(cli("sweep", spec, "--out", tmp_path / "out"), "symbolic link", "refusing")
    assert list(elsewhere.iterdir()) == []


def test_a_record_folder_link_is_refused_by_the_writer(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    os.symlink(elsewhere, tmp_path / "out" / "s")
    rec = {"cell_id": "c1", "spec": "s", "system": "baseline", "status": "ok"}
    with pytest.raises(UnsafePathError, match="symbolic link"):
        write_records(tmp_path / "out" / "s" / "c1.parquet", [rec], root=tmp_path / "out")
    assert list(elsewhere.iterdir()) == []


# ---- break 6: records are verified on read ----------------------------------------------------------------


def _forge(good: Path, path: Path, **change) -> None:
    """A copy of the record ``good`` with columns replaced (pyarrow: every other column keeps its type)."""
    table = pq.read_table(good)
    for col, value in change.items():
        table = table.set_column(table.schema.get_field_index(col), col, pa.array([value] * table.num_rows))
    pq.write_table(table, path)


def test_forged_records_are_reported_and_the_cell_runs_again(swept, tmp_path):
    spec, out = swept
    cell = _cell(spec)
    good = spec_folder(out, "tiny") / f"{cell.cell_id}.parquet"
    forged_out = tmp_path / "out"
    folder = spec_folder(forged_out, "tiny")
    folder.mkdir(parents=True)
    path = folder / f"{cell.cell_id}.parquet"
    cases = {
        "not a pf-bench record": lambda: pd.DataFrame({"status": ["ok"]}).to_parquet(path),
        "holds cell '0123456789ab'": lambda: _forge(good, path, cell_id="0123456789ab"),
        "status 'done' is not one of": lambda: _forge(good, path, status="done"),
        "column 'n' is string, not int64": lambda: _forge(good, path, n="two"),
        "holds spec 'other'": lambda: _forge(good, path, spec="other"),
        "holds systems ['prefixflow']": lambda: _forge(good, path, system="prefixflow"),
        "not a readable Parquet file": lambda: path.write_bytes(b"PAR1 garbage"),
        "not a regular file": lambda: os.mkfifo(path),
        "cannot open": lambda: os.symlink(good, path),  # even a link to a good record
        "200001 rows": lambda: pd.DataFrame({"status": ["ok"] * 200_001}).to_parquet(path),  # bounded work
    }
    for reason, forge in cases.items():
        path.unlink(missing_ok=True)
        forge()
        p = plan(load_spec(spec), forged_out)
        assert [c.cell_id for c in p.todo] == [cell.cell_id], reason
        assert len(p.invalid) == 1 and str(path) in p.invalid[0] and reason in p.invalid[0], (
            reason,
            p.invalid,
        )
        res = cli("sweep", spec, "--out", forged_out, "--dry-run")
        assert res.exit_code == 0 and "warning: ignoring" in res.output and "1 to run" in res.output, reason


def test_collect_and_status_skip_bad_files_by_name(swept, tmp_path):
    spec, out = swept
    cell = _cell(spec)
    folder = spec_folder(out, "tiny")
    bad = folder / "0123456789ab.parquet"
    pd.DataFrame({"cell_id": ["x"], "wrong": [1]}).to_parquet(bad)  # wrong columns: once an all-NaN row
    manifest = (folder / "_manifest.json").read_bytes()
    try:
        problems: list[str] = []
        df = collect(out, problems=problems)
        assert (
            list(df["cell_id"].unique()) == [cell.cell_id] and len(problems) == 1 and str(bad) in problems[0]
        )
        for corrupt in (
            b"{not json",
            b"[1, 2]",
            json.dumps({"spec": "tiny", "cells": ["../../../etc/passwd"]}).encode(),
            b"\xff" * 100,
        ):
            (folder / "_manifest.json").write_bytes(corrupt)
            res = cli("status", out)
            assert res.exit_code == 0 and "_manifest.json" in res.output and "Traceback" not in res.output, (
                res.output
            )
            assert status_table(out).set_index("spec").loc["tiny", "ok"] == 1
    finally:
        bad.unlink()
        (folder / "_manifest.json").write_bytes(manifest)


def test_collect_refuses_to_write_inside_a_results_tree(swept, tmp_path):
    spec, out = swept
    record = spec_folder(out, "tiny") / f"{_cell(spec).cell_id}.parquet"
    before = record.read_bytes()
    user_error(cli("collect", out, "-o", record), "inside the results folder")
    user_error(cli("collect", out, "-o", out / "all.parquet"), "inside the results folder")
    os.symlink(record, tmp_path / "looks-outside.parquet")  # a link that leads back in
    user_error(cli("collect", out, "-o", tmp_path / "looks-outside.parquet"), "inside the results folder")
    other = tmp_path / "other-results"  # another results tree: any folder holding a sweep's manifest
    (other / "spec").mkdir(parents=True)
    (other / "spec" / "_manifest.json").write_text("{}")
    user_error(cli("collect", out, "-o", other / "spec" / "x.parquet"), "inside the results folder")
    user_error(cli("collect", out, "-o", other / "all.parquet"), "inside the results folder")
    assert record.read_bytes() == before
    res = cli("collect", out, "-o", tmp_path / "all.parquet")
    assert res.exit_code == 0 and len(pd.read_parquet(tmp_path / "all.parquet")) == 1


def test_read_records_names_the_problem():
    with pytest.raises(InvalidRecord, match="cannot open"):
        read_records("/nonexistent/c1.parquet")
