"""make gpu-wheels / gpu-check / device-env-check (scripts/gpu_wheels.py, gpu_env.py, gpu_check.sh) on CPU:
the wheel list and the wheel set that may travel, the stamp that vouches for a tree without .git, the
summary, and gpu-check's no-venv path up to its "no CUDA device" stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest
import torch
from support import REPO
from typer.testing import CliRunner

sys.path.insert(0, str(REPO / "scripts"))
import gpu_env  # noqa: E402
import gpu_wheels  # noqa: E402
from packaging.tags import Tag  # noqa: E402

from harness.cli import app  # noqa: E402
from harness.run import columns  # noqa: E402


def write_list(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpu_wheels.txt"
    path.write_text(text)
    return path


def test_the_project_list_pins_each_package_once_and_never_torch():
    pins = gpu_wheels.read_pins()
    names = [p.name for p in pins]
    assert len(names) == len(set(names)) and {"torchtitan", "pydantic", "submitit", "trl"} <= set(names)
    assert not any(n.startswith(("torch-", "nvidia", "cuda")) or n in ("torch", "triton") for n in names)
    assert [p.name for p in pins if p.shadow] == ["typing-extensions"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("pydantic>=2\n", "3: 'pydantic>=2': write NAME==VERSION"),
        ("pydantic==2.1\nPydantic==2.2\n", r"4: pydantic is listed twice \(also line 3\)"),
        ("torch==2.11.0\n", "3: torch must not travel"),
        ("nvidia-cublas==13.0.0\n", "3: nvidia-cublas must not travel"),
        (
            "dill==0.4.1 shadows\n",
            "3: 'dill==0.4.1 shadows': write NAME==VERSION, optionally followed by 'shadow'",
        ),
        ("dill==x.y\n", "3: 'x.y' is not a version"),
    ],
)
def test_a_bad_list_is_refused_naming_the_line(tmp_path, text, message):
    with pytest.raises(gpu_wheels.WheelSetError, match="gpu_wheels.txt:" + message):
        gpu_wheels.read_pins(write_list(tmp_path, "# comment\n\n" + text))


def fake_wheel(folder: Path, filename: str, size: int = 100) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / filename
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("payload", os.urandom(size))
    return path


PINS_TEXT = "dill==0.4.1\npydantic-core==2.50.5\ntyping-extensions==4.16.0 shadow\n"
GOOD = [
    "dill-0.4.1-py3-none-any.whl",
    "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "typing_extensions-4.16.0-py3-none-any.whl",
]


def test_verify_accepts_exactly_the_pins_and_sums_their_size(tmp_path):
    pins = gpu_wheels.read_pins(write_list(tmp_path, PINS_TEXT))
    folder = tmp_path / "wheels"
    made = [fake_wheel(folder, name) for name in GOOD]
    (folder / gpu_wheels.STAMP).write_text("{}")
    wheels, total = gpu_wheels.verify(pins, folder)
    assert [w.name for w in wheels] == GOOD and total == sum(p.stat().st_size for p in made)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: (f / GOOD[0]).unlink(), "dill==0.4.1: no wheel"),
        (lambda f: fake_wheel(f, "dill-0.4.0-py3-none-any.whl"), "version 0.4.0, but gpu_wheels.txt pins dill==0.4.1"),
        (lambda f: fake_wheel(f, "dill-0.4.1-py2.py3-none-any.whl"), "a second wheel of dill"),
        (lambda f: fake_wheel(f, "six-1.0-py3-none-any.whl"), "six is not in gpu_wheels.txt"),
        (lambda f: (f / "notes.txt").write_text("x"), "notes.txt: not a wheel"),
        (lambda f: _swap(f, GOOD[1], GOOD[1].replace("cp312-cp312", "cp311-cp311")), "not installable on CPython 3.12"),
        (lambda f: _swap(f, GOOD[1], GOOD[1].replace("manylinux2014_x86_64.manylinux_2_17_x86_64", "manylinux_2_17_aarch64")), "not installable"),
    ],
)  # fmt: skip
def test_verify_names_what_may_not_travel(tmp_path, change, message):
    pins = gpu_wheels.read_pins(write_list(tmp_path, PINS_TEXT))
    folder = tmp_path / "wheels"
    for name in GOOD:
        fake_wheel(folder, name)
    change(folder)
    with pytest.raises(gpu_wheels.WheelSetError, match=message):
        gpu_wheels.verify(pins, folder)


def _swap(folder: Path, old: str, new: str) -> None:
    (folder / old).rename(folder / new)


def test_verify_refuses_a_set_at_the_size_limit(tmp_path):
    pins = gpu_wheels.read_pins(write_list(tmp_path, PINS_TEXT))
    folder = tmp_path / "wheels"
    total = sum(fake_wheel(folder, name, size=4000).stat().st_size for name in GOOD)
    assert gpu_wheels.verify(pins, folder, limit=total + 1)[1] == total
    with pytest.raises(gpu_wheels.WheelSetError, match="over the"):
        gpu_wheels.verify(pins, folder, limit=total)


def test_machine_tags_are_cpython_312_manylinux_x86_64_up_to_glibc_2_39():
    tags = gpu_wheels.machine_tags()
    ok = [
        ("py3", "none", "any"),
        ("cp312", "cp312", "manylinux_2_39_x86_64"),
        ("cp38", "abi3", "manylinux2014_x86_64"),
    ]
    bad = [("cp311", "cp311", "manylinux_2_17_x86_64"), ("cp312", "cp312", "manylinux_2_40_x86_64"),
           ("cp312", "cp312", "linux_x86_64"), ("cp312", "cp312", "macosx_11_0_arm64")]  # fmt: skip
    assert all(Tag(*t) in tags for t in ok) and not any(Tag(*t) in tags for t in bad)


def git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_the_stamp_vouches_for_the_stamped_tree_only(tmp_path):
    repo, folder = tmp_path / "repo", tmp_path / "repo" / "wheels"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("a = 1\n")
    (repo / "b.txt").write_text("b\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    folder.mkdir()
    stamp = gpu_wheels.write_stamp(folder, repo)
    head = git(repo, "rev-parse", "--short=12", "HEAD")
    assert stamp["rev"] == head and not stamp["dirty"] and stamp["paths"] == ["b.txt", "pkg/a.py"]
    assert gpu_env.revision(folder / gpu_wheels.STAMP, repo)[0] == head
    (repo / "untracked.txt").write_text("not in the stamp, not in the revision\n")
    assert gpu_env.revision(folder / gpu_wheels.STAMP, repo)[0] == head
    (repo / "pkg" / "a.py").write_text("a = 2\n")  # the tree that travelled is not the stamped one
    rev, why = gpu_env.revision(folder / gpu_wheels.STAMP, repo)
    assert rev == "unknown" and "changed since" in why
    gpu_wheels.write_stamp(folder, repo)  # stamped with the change uncommitted
    assert gpu_env.revision(folder / gpu_wheels.STAMP, repo)[0] == head + "-dirty"
    (folder / gpu_wheels.STAMP).write_text(json.dumps({"rev": "$(rm -rf /)", "paths": [], "sha256": ""}))
    assert gpu_env.revision(folder / gpu_wheels.STAMP, repo)[0] == "unknown"
    assert gpu_env.revision(folder / "absent.json", repo)[0] == "unknown"


def test_records_take_pf_git_rev_only_outside_a_checkout(monkeypatch):
    monkeypatch.setenv("PF_GIT_REV", "0123456789ab")
    for answer, want in (("unknown", "0123456789ab"), ("fedcba987654", "fedcba987654")):
        monkeypatch.setattr(columns, "_git_rev", lambda a=answer: a)
        columns.git_rev.cache_clear()
        assert columns.git_rev() == want
    monkeypatch.delenv("PF_GIT_REV")
    monkeypatch.setattr(columns, "_git_rev", lambda: "unknown")
    columns.git_rev.cache_clear()
    assert columns.git_rev() == "unknown"
    columns.git_rev.cache_clear()


def test_a_venv_with_other_pins_or_the_carried_packages_cannot_stand_in(tmp_path):
    """Another torch than the pinned one, and a package that travels (pydantic) found installed, are named."""
    pins = tmp_path / "device_env.txt"
    pins.write_text(f"# machine\ntorch==0.0.1\npytest=={pytest.__version__}\nrich\n")
    problems = gpu_env.stand_in_problems(pins)
    assert f"torch is {gpu_env._version('torch')}, the machine has 0.0.1" in problems
    assert any(p.startswith("pydantic ") and "it travels" in p for p in problems)
    assert not any(p.startswith(("pytest", "typing-extensions", "rich")) for p in problems)


def test_the_summary_states_the_speed_cell_against_the_baseline(tmp_path, monkeypatch):
    import harness.records

    rows = [
        dict(system="baseline", offload=False, status="ok", step_time_s=2.0, phase_a_s=None),
        dict(system="prefixflow", offload=False, status="ok", step_time_s=0.5, phase_a_s=0.1),
        dict(system="prefixflow", offload=True, status="ok", step_time_s=0.8, phase_a_s=0.1),
        dict(system="prefixflow", offload=True, status="oom", step_time_s=float("nan"), phase_a_s=None),
    ]
    for r in rows:
        r.update(phase_b_s=0.3, phase_c_s=0.1, peak_mem_bytes=2**31, peak_mem_phase_b_bytes=2**30)
        r.update(mem_meter="cuda-max-allocated", git_rev="abc")
    monkeypatch.setattr(harness.records, "collect", lambda root: pd.DataFrame(rows))
    (tmp_path / "steps.tsv").write_text("speed\tok\t0\t41\t\nsmoke\ttimeout\t124\t90\t\n")
    (tmp_path / "environment.json").write_text(
        json.dumps({"gpu": "NVIDIA H200", "driver": "580", "gpu_count": 1, "torch": "2.11.0+cu130",
                    "torch_cuda": "13.0", "python": "3.12.3"})
    )  # fmt: skip
    s = gpu_env.summary(tmp_path)
    speed = {(r["system"], r["status"]): r for r in s["speed"]}
    assert (
        speed[("prefixflow", "ok")]["speedup"] == 4.0
        and speed[("prefixflow+offload", "ok")]["speedup"] == 2.5
    )
    assert speed[("prefixflow+offload", "oom")]["step_time_s"] is None
    md = (tmp_path / "summary.md").read_text()
    assert "NVIDIA H200" in md and "| smoke | timeout | 90 |" in md and "| prefixflow | 0.500 | 4.00 |" in md
    assert json.loads((tmp_path / "summary.json").read_text())["steps"][1]["rc"] == 124


def test_align_refuses_a_device_it_cannot_use():
    runner = CliRunner()
    cases = [
        (["--device", "tpu"], "use auto, cpu or cuda"),
        (["--device", "cpu", "--tp", "2"], "one process"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no CUDA device"))
    for args, message in cases:
        res = runner.invoke(app, ["align", *args])
        assert res.exit_code == 2 and message in res.output, res.output


def run_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_PYTHON": sys.executable, "GPU_WHEELS": str(tmp_path / "no-wheels"), **env}
    env.pop("OUT", None)
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=600
    )


def test_gpu_check_refuses_a_results_folder_it_did_not_make(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "records.parquet").write_text("keep me")
    res = run_check(tmp_path, GPU_RESULTS=str(tmp_path / "mine"))
    assert res.returncode == 2 and "was not made by gpu-check" in res.stderr
    assert (tmp_path / "mine" / "records.parquet").read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: a CUDA machine runs the GPU steps")
def test_gpu_check_imports_everything_then_stops_with_one_line_without_cuda(tmp_path):
    results = tmp_path / "gpu"
    res = run_check(tmp_path, GPU_RESULTS=str(results))
    lines = res.stdout.splitlines()
    assert res.returncode == 3, res.stdout + res.stderr
    assert any(line.startswith("imported ") and "modules of prefixflow and harness" in line for line in lines)
    assert [line for line in lines if "CUDA" in line] == [lines[-1]] and lines[-1].startswith(
        "no CUDA device: "
    )
    env = json.loads((results / "environment.json").read_text())
    assert env["cuda_available"] is False and env["torch"] == torch.__version__
    assert (results / "gpu_check.log").read_text().splitlines()[-1] == lines[-1]
    assert (results / "steps.tsv").read_text() == ""  # no GPU step ran
