"""The Python half of ``make gpu-check`` (scripts/gpu_check.sh runs it with the machine's own python).

  revision     the git revision for the records, from wheels/REVISION.json if the tree is the one stamped
  requirements every carried wheel is the copy that imports, and what each needs is there (missing: exit 1)
  imports      import every module of prefixflow and harness and each package they use (exit 1 naming each)
  environment  record python, torch, CUDA, driver and GPU as JSON; without a CUDA device print one line, exit 3
  summary      steps, environment and the speed cell's records as summary.json and summary.md
  stand-in     this interpreter can stand in for the machine's (make device-env-check): the pinned versions
               of scripts/device_env.txt, and none of the packages that travel as wheels

Nothing here needs the project installed: it runs with the carried wheels' target folder and the repository
on PYTHONPATH, as on the lent machine (no .venv, no registry).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import pkgutil
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from gpu_wheels import FOLDER, STAMP, mib, read_pins, tree_digest, verify
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = 3  # exit status of `environment` on a machine without a CUDA device
# Packages the library and the harness import (at module level or on first use); versions are recorded.
PACKAGES = (
    "torch", "torchtitan", "transformers", "trl", "peft", "accelerate", "datasets", "tokenizers", "safetensors",
    "pydantic", "submitit", "prefix_grouper", "numpy", "pandas", "pyarrow", "matplotlib", "seaborn", "rich",
    "typer", "yaml", "pytest",
)  # fmt: skip
# Subpackages whose dependency does not travel: verl 0.9.1 has its own venv (`make test-verl`).
NOT_CARRIED = {"prefixflow.integrations.verl": "verl"}


def revision(stamp_path: Path, repo: Path = REPO) -> tuple[str, str]:
    """(revision, why): the stamped revision when every stamped file still has its stamped bytes, else
    ``unknown`` and the reason."""
    try:
        stamp = json.loads(stamp_path.read_text())
        rev, paths, want = str(stamp["rev"]), list(stamp["paths"]), str(stamp["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return "unknown", f"no readable stamp {stamp_path} ({type(e).__name__}); run make gpu-wheels"
    if not rev.isalnum() or len(rev) > 40 or not all(isinstance(p, str) for p in paths):
        return "unknown", f"{stamp_path}: not a stamp make gpu-wheels wrote"
    if tree_digest(paths, repo) != want:
        return (
            "unknown",
            "tracked files changed since make gpu-wheels stamped them; run it again before the run",
        )
    return rev + ("-dirty" if stamp.get("dirty") else ""), f"tree matches the stamp of {rev}"


def requirements(folder: Path) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the carried wheels in this interpreter: each listed package must import from
    the carried copy at its pinned version; each requirement of a wheel must be installed (else an error)
    at a version in its range (else a warning: the machine's own packages are what they are)."""
    errors, warnings = [], []
    pins = read_pins()
    wheels, _ = verify(pins, folder)
    marker_env = {**default_environment(), "extra": ""}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            meta = zf.read(meta_name).decode()
        pin = next(p for p in pins if p.name == parse_wheel_filename(wheel.name)[0])
        found = _version(pin.name)
        if found is None or Version(found) != pin.version:
            errors.append(f"{pin.name}: {found or 'not importable'} imports, not the carried {pin.version}")
        for line in meta.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(marker_env):
                continue
            have = _version(req.name)
            if have is None:
                errors.append(f"{pin.name} needs {req}: not installed here and not carried")
            elif req.specifier and not req.specifier.contains(have, prereleases=True):
                warnings.append(f"{pin.name} asks for {req}; this machine has {req.name} {have}")
    return errors, warnings


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def stand_in_problems(pins_file: Path) -> list[str]:
    """Why this interpreter cannot stand in for the lent machine's: a package of ``pins_file`` at another
    version, or a package that travels as a wheel (and is not marked ``shadow``) installed here."""
    problems = []
    for line in pins_file.read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if "==" in req:
            name, version = req.split("==")
            have = _version(name)
            if have is None or Version(have) != Version(version):
                problems.append(f"{name} is {have or 'missing'}, the machine has {version}")
    for pin in read_pins():
        if not pin.shadow and _version(pin.name) is not None:
            problems.append(f"{pin.name} {_version(pin.name)} is installed; the machine lacks it (it travels)")
    return problems


def import_everything() -> tuple[int, list[str]]:
    """(modules imported, failures): every module of prefixflow and harness, then each of PACKAGES."""
    failures, count = [], 0
    for top in ("prefixflow", "harness"):
        package = importlib.import_module(top)
        for module in pkgutil.walk_packages(package.__path__, top + "."):
            name = module.name
            if name.endswith(".__main__"):
                continue  # running it is the command itself
            skip = next((dep for sub, dep in NOT_CARRIED.items() if name.startswith(sub)), None)
            if skip and importlib.util.find_spec(skip) is None:
                continue
            try:
                importlib.import_module(name)
                count += 1
            except Exception as e:  # every failure is reported, not only the first
                failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    for name in PACKAGES:
        try:
            importlib.import_module(name)
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")
    return count, failures


def environment() -> dict:
    """What this machine is: interpreter, package versions, torch's CUDA build and the GPU with its driver."""
    import torch

    env = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "packages": {name: _version("pyyaml" if name == "yaml" else name) for name in PACKAGES},
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if not env["cuda_available"]:
        return env
    props = torch.cuda.get_device_properties(0)
    env.update(
        gpu=props.name,
        gpu_count=torch.cuda.device_count(),
        capability=f"{props.major}.{props.minor}",
        gpu_memory_bytes=props.total_memory,
        multiprocessors=props.multi_processor_count,
        cudnn=torch.backends.cudnn.version(),
        nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
        driver=_driver_version(),
    )
    return env


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:
        return None


def no_cuda_line(env: dict) -> str:
    build = f"CUDA {env['torch_cuda']} build" if env["torch_cuda"] else "CPU-only build"
    return (
        f"no CUDA device: torch {env['torch']} ({build}) sees none; the wheels installed and every module "
        "imported, so the GPU steps stop here"
    )


def speed_table(results: Path) -> list[dict]:
    """One row per system of the speed cell's records (``results/adhoc``): median step time, phases, peaks,
    and the speedup over the baseline of the same run."""
    from harness.records import collect

    df = collect(results / "adhoc")
    if df.empty:
        return []
    rows = []
    base = df[(df.system == "baseline") & (df.status == "ok")]
    base_time = float(base.step_time_s.iloc[0]) if len(base) else None
    for _, r in df.sort_values(["offload", "system"]).iterrows():
        ok = r.status == "ok"
        row = {
            "system": r.system + ("+offload" if r.offload and r.system != "baseline" else ""),
            "status": r.status,
            "step_time_s": float(r.step_time_s) if ok else None,
            "speedup": base_time / float(r.step_time_s) if ok and base_time else None,
            "peak_mem_gib": float(r.peak_mem_bytes) / 2**30 if ok else None,
            "peak_mem_phase_b_gib": float(r.peak_mem_phase_b_bytes) / 2**30 if ok else None,
            "mem_meter": r.mem_meter if ok else None,
            "git_rev": r.git_rev,
        }
        for phase in "abc":
            value = r.get(f"phase_{phase}_s")
            row[f"phase_{phase}_s"] = float(value) if ok and value == value and value is not None else None
        rows.append(row)
    return rows


def read_steps(path: Path) -> list[dict]:
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, rc, seconds, *note = line.split("\t")
        steps.append(
            {"step": name, "status": status, "rc": int(rc), "seconds": float(seconds), "note": " ".join(note)}
        )
    return steps


def summary(results: Path) -> dict:
    env_path = results / "environment.json"
    out = {
        "environment": json.loads(env_path.read_text()) if env_path.exists() else None,
        "steps": read_steps(results / "steps.tsv"),
        "speed": speed_table(results),
    }
    (results / "summary.json").write_text(json.dumps(out, indent=1))
    (results / "summary.md").write_text(summary_markdown(out))
    return out


def summary_markdown(s: dict) -> str:
    env = s["environment"] or {}
    lines = ["# make gpu-check", ""]
    if env:
        lines.append(
            f"{env.get('gpu', 'no GPU')} (driver {env.get('driver')}, {env.get('gpu_count', 0)} device(s)), "
            f"torch {env['torch']} CUDA {env['torch_cuda']}, Python {env['python']}"
        )
        lines.append("")
    lines += ["| step | status | seconds | note |", "| --- | --- | --- | --- |"]
    lines += [f"| {t['step']} | {t['status']} | {t['seconds']:.0f} | {t['note']} |" for t in s["steps"]]
    if s["speed"]:
        lines += [
            "",
            "| system | step (s) | speedup | A (s) | B (s) | C (s) | peak (GiB) | phase B peak (GiB) |",
        ]
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")

        def f(v, digits=3):
            return "-" if v is None else f"{v:.{digits}f}"

        for r in s["speed"]:
            lines.append(
                f"| {r['system']} | {f(r['step_time_s'])} | {f(r['speedup'], 2)} | {f(r['phase_a_s'])} | "
                f"{f(r['phase_b_s'])} | {f(r['phase_c_s'])} | {f(r['peak_mem_gib'], 1)} | "
                f"{f(r['peak_mem_phase_b_gib'], 1)} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("revision").add_argument("--stamp", type=Path, default=FOLDER / STAMP)
    sub.add_parser("requirements").add_argument("--wheels", type=Path, default=FOLDER)
    sub.add_parser("imports")
    sub.add_parser("environment").add_argument("--out", type=Path)
    sub.add_parser("summary").add_argument("results", type=Path)
    sub.add_parser("stand-in").add_argument("--pins", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.action == "revision":
        rev, why = revision(args.stamp)
        print(why, file=sys.stderr)
        print(rev)
    elif args.action == "requirements":
        errors, warnings = requirements(args.wheels)
        for w in warnings:
            print(f"warning: {w}")
        for e in errors:
            print(f"error: {e}")
        if errors:
            return 1
        print(f"{len(read_pins())} carried packages import from the wheels; every requirement is installed")
    elif args.action == "imports":
        count, failures = import_everything()
        for f in failures:
            print(f"import failed: {f}")
        if failures:
            return 1
        print(f"imported {count} modules of prefixflow and harness and {len(PACKAGES)} packages")
    elif args.action == "environment":
        env = environment()
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(env, indent=1))
        versions = ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
        print(f"python {env['python']}: {versions}")
        if not env["cuda_available"]:
            print(no_cuda_line(env))
            return NO_CUDA
        print(
            f"GPU: {env['gpu']} x{env['gpu_count']} (sm {env['capability']}, {mib(env['gpu_memory_bytes'])}), "
            f"driver {env['driver']}, torch {env['torch']} built for CUDA {env['torch_cuda']}"
        )
    elif args.action == "stand-in":
        problems = stand_in_problems(args.pins)
        for p in problems:
            print(f"{sys.executable} cannot stand in for the lent machine: {p}")
        if problems:
            return 1
    elif args.action == "summary":
        s = summary(args.results)
        print(summary_markdown(s), end="")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
