"""The wheels that travel to the lent GPU machine (``make gpu-wheels``) and the stamp of the tree they go with.

That machine runs Python 3.12.3 with its own torch and reaches no registry, so every package PrefixFlow needs
there and the machine lacks travels as a wheel in ``wheels/`` (git-ignored, carried with the working tree;
tree plus wheels at most 64 MiB, so the wheels stay under 48 MiB). ``scripts/gpu_wheels.txt`` names them.

  python scripts/gpu_wheels.py download   # fetch what is missing, drop what is stale, verify, stamp
  python scripts/gpu_wheels.py verify     # verify only (exit 1 naming each problem)
  python scripts/gpu_wheels.py names      # the packages the machine lacks (the pins less the shadows)

The stamp ``wheels/REVISION.json`` holds the git revision and a digest of every tracked file: the GPU
machine has no ``.git``, so ``scripts/gpu_env.py revision`` recomputes the digest there and the records get
this revision only if the tree is the one stamped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LIST = REPO / "scripts" / "gpu_wheels.txt"
FOLDER = REPO / "wheels"
STAMP = "REVISION.json"
LIMIT_BYTES = 48 * 2**20
# The lent machine: CPython 3.12 on x86-64 Linux. Its Python 3.12.3 is Ubuntu 24.04's, whose glibc is 2.39.
PYTHON_VERSION = (3, 12)
MACHINE_GLIBC = 39
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(MACHINE_GLIBC, 16, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
# The machine's torch and its CUDA stack must never be shadowed by a carried copy.
NEVER = ("torch", "triton", "nvidia-", "cuda-")


class WheelSetError(ValueError):
    """The list or the wheel folder is not what may travel; the message has one line per problem."""


@dataclass(frozen=True)
class Pin:
    name: str  # canonical (PEP 503)
    version: Version
    shadow: bool  # the machine has the package too (version unread); the carried one wins on PYTHONPATH

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def read_pins(path: Path = LIST) -> list[Pin]:
    """The pins of ``path``: ``NAME==VERSION [shadow]  # why`` per line; refuses loose or repeated names."""
    pins: list[Pin] = []
    problems = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path.name}:{number}"
        if len(words) > 2 or (len(words) == 2 and words[1] != "shadow") or words[0].count("==") != 1:
            problems.append(f"{where}: {raw.strip()!r}: write NAME==VERSION, optionally followed by 'shadow'")
            continue
        name, version = words[0].split("==")
        name = canonicalize_name(name)
        if any(name == n or (n.endswith("-") and name.startswith(n)) for n in NEVER):
            problems.append(f"{where}: {name} must not travel (the machine's torch and CUDA stack stay)")
            continue
        if name in seen:
            problems.append(f"{where}: {name} is listed twice (also line {seen[name]}): keep one version")
            continue
        try:
            pins.append(Pin(name, Version(version), len(words) == 2))
        except ValueError:
            problems.append(f"{where}: {version!r} is not a version")
            continue
        seen[name] = number
    if problems:
        raise WheelSetError("\n".join(problems))
    return pins


def machine_tags() -> set[Tag]:
    """Every wheel tag pip on the lent machine accepts (CPython 3.12, manylinux x86-64 up to its glibc)."""
    return set(cpython_tags(PYTHON_VERSION, platforms=PLATFORMS)) | set(
        compatible_tags(PYTHON_VERSION, "cp312", platforms=PLATFORMS)
    )


def verify(pins: list[Pin], folder: Path = FOLDER, limit: int = LIMIT_BYTES) -> tuple[list[Path], int]:
    """The folder's wheels and their total size, if they are exactly ``pins`` (one wheel per pin, at its
    version, installable on the machine) and smaller than ``limit``; else ``WheelSetError``."""
    want = {p.name: p for p in pins}
    accepted = machine_tags()
    problems = []
    found: dict[str, Path] = {}
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    for extra in sorted(set(folder.iterdir()) - set(wheels)) if folder.is_dir() else []:
        if extra.name != STAMP:
            problems.append(f"{extra.name}: not a wheel; only wheels and {STAMP} travel in {folder.name}/")
    for wheel in wheels:
        try:
            name, version, _, tags = parse_wheel_filename(wheel.name)
        except ValueError as e:
            problems.append(f"{wheel.name}: {e}")
            continue
        pin = want.get(name)
        if pin is None:
            problems.append(f"{wheel.name}: {name} is not in {LIST.name}")
        elif version != pin.version:
            problems.append(f"{wheel.name}: version {version}, but {LIST.name} pins {pin}")
        elif name in found:
            problems.append(f"{wheel.name}: a second wheel of {name} (also {found[name].name}): keep one")
        elif not tags & accepted:
            problems.append(f"{wheel.name}: not installable on CPython 3.12 manylinux x86-64")
        else:
            found[name] = wheel
    problems += [
        f"{p}: no wheel in {folder.name}/ (run make gpu-wheels)" for p in pins if p.name not in found
    ]
    total = sum(w.stat().st_size for w in wheels)
    if total >= limit:
        problems.append(
            f"the wheels take {mib(total)}, over the {mib(limit)} that may travel beside the tree"
        )
    if problems:
        raise WheelSetError("\n".join(problems))
    return [found[p.name] for p in pins], total


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def download(pins: list[Pin], folder: Path = FOLDER, python: str = sys.executable) -> None:
    """Fetch each pin missing from ``folder`` (``pip download --no-deps``, CPython 3.12 manylinux x86-64
    binaries only) after deleting the folder's wheels that no pin names at their version."""
    folder.mkdir(exist_ok=True)
    wanted = {(p.name, p.version) for p in pins}
    have = set()
    for wheel in folder.glob("*.whl"):
        try:
            name, version, _, _ = parse_wheel_filename(wheel.name)
        except ValueError:
            name, version = "", None
        if (name, version) in wanted and (name, version) not in have:
            have.add((name, version))
        else:
            wheel.unlink()
    missing = [str(p) for p in pins if (p.name, p.version) not in have]
    if not missing:
        return
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), *missing]
    subprocess.run(command, check=True)


def tracked_files(repo: Path = REPO) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
    return sorted(p for p in out.decode().split("\0") if p)


def tree_digest(paths: list[str], repo: Path = REPO) -> str:
    """sha256 over each path and its bytes (a link: its target, as it travels; a missing file: a marker)."""
    digest = hashlib.sha256()
    for rel in sorted(paths):
        path = repo / rel
        if path.is_symlink():
            body = b"link:" + os.readlink(path).encode()
        elif path.is_file():
            body = hashlib.sha256(path.read_bytes()).digest()
        else:
            body = b"missing"
        digest.update(rel.encode() + b"\0" + body + b"\0")
    return digest.hexdigest()


def write_stamp(folder: Path = FOLDER, repo: Path = REPO) -> dict:
    """``folder/REVISION.json``: HEAD's short revision, whether tracked files differ from it, the digest."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)

    rev = git("rev-parse", "--short=12", "HEAD").stdout.strip()
    if not rev:
        raise WheelSetError(f"{repo} is not a git checkout: nothing to stamp")
    paths = tracked_files(repo)
    stamp = {
        "rev": rev,
        "dirty": git("diff", "--quiet", "HEAD", "--").returncode == 1,
        "sha256": tree_digest(paths, repo),
        "paths": paths,
    }
    tmp = folder / (STAMP + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=0))
    tmp.replace(folder / STAMP)
    return stamp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["download", "verify", "names"])
    parser.add_argument("--folder", type=Path, default=FOLDER)
    parser.add_argument("--list", type=Path, default=LIST)
    args = parser.parse_args(argv)
    try:
        pins = read_pins(args.list)
        if args.action == "names":  # what the machine lacks: the packages that travel, less the shadows
            print(" ".join(p.name for p in pins if not p.shadow))
            return 0
        if args.action == "download":
            download(pins, args.folder)
        wheels, total = verify(pins, args.folder)
        if args.action == "download":
            stamp = write_stamp(args.folder)
            print(f"stamped {stamp['rev']}{'-dirty' if stamp['dirty'] else ''} ({len(stamp['paths'])} files)")
    except WheelSetError as e:
        print(f"gpu-wheels: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"gpu-wheels: {' '.join(e.cmd[:4])} ... failed (exit {e.returncode})", file=sys.stderr)
        return 1
    print(f"{args.folder.name}/: {len(wheels)} wheels, {mib(total)} (limit {mib(LIMIT_BYTES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
