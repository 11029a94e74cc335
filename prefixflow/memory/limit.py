"""How much memory this process may still take, and a one-line refusal of what cannot fit, before anything is
allocated.

The limit is the smallest of:

- the host's ``MemAvailable`` (``/proc/meminfo``);
- the headroom under ``RLIMIT_AS`` (``ulimit -v``): the soft limit minus the address space in use;
- the cgroup's headroom: ``memory.max`` minus ``memory.current`` (cgroup v2), ``memory.limit_in_bytes``
  minus ``memory.usage_in_bytes`` (v1), for this process's cgroup and every one above it;
- a configured budget: the ``budget`` argument, else ``$PF_MEMORY_LIMIT`` (bytes, or with a K/M/G/T suffix:
  ``64G``).

Sources that cannot be read are skipped (another OS, no cgroup); none readable means no limit (None).
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "Limit", "MemoryRefusal", "memory_limit", "parse_bytes", "check_fits", "gib"]

ENV = "PF_MEMORY_LIMIT"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_CGROUP_ROOT = Path("/sys/fs/cgroup")


class MemoryRefusal(ValueError):
    """What was asked for cannot fit in the memory this process may take (raised before any allocation)."""


@dataclass(frozen=True)
class Limit:
    """``bytes`` this process may still take, and which source set it (e.g. ``MemAvailable``)."""

    bytes: int
    source: str


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def parse_bytes(text: str) -> int:
    """``'123'``, ``'64G'``, ``'1.5GiB'`` -> bytes; ValueError otherwise."""
    m = _BYTES.fullmatch(str(text))
    if m is None:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 68719476736 or 64G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _address_space_headroom() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    used = 0
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    used = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(0, soft - used)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2's no limit) is not a number


def _cgroup_headroom(root: Path = _CGROUP_ROOT, membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """The smallest limit-minus-usage over this process's memory cgroups and their ancestors."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2
            base, limit_file, usage_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            base, limit_file, usage_file = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder = base / rel.lstrip("/")
        while True:
            limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
            if limit is not None and usage is not None and limit < 2**60:  # v1 writes 2^63 for "none"
                headroom = max(0, limit - usage)
                best = headroom if best is None else min(best, headroom)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return best


def _configured() -> int | None:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        return parse_bytes(raw)
    except ValueError:
        raise ValueError(
            f"${ENV}={raw[:40]!r} is not a size in bytes; set e.g. {ENV}=64G or unset it"
        ) from None


def memory_limit(budget: int | None = None) -> Limit | None:
    """The memory this process may still take (the smallest source, see the module doc), or None when no
    source can be read."""
    configured = budget if budget is not None else _configured()
    sources = [
        (_mem_available(), "MemAvailable"),
        (_address_space_headroom(), "the RLIMIT_AS (ulimit -v) headroom"),
        (_cgroup_headroom(), "the cgroup's memory.max headroom"),
        (configured, f"the configured budget (${ENV})" if budget is None else "the configured budget"),
    ]
    known = [Limit(int(n), source) for n, source in sources if n is not None]
    return min(known, key=lambda lim: lim.bytes) if known else None


def check_fits(need: int, what: str, fix: str, budget: int | None = None) -> None:
    """Raise :class:`MemoryRefusal` (one line: what needs how much, the limit and its source, the fix) when
    ``need`` bytes exceed :func:`memory_limit`."""
    limit = memory_limit(budget)
    if limit is not None and need > limit.bytes:
        raise MemoryRefusal(
            f"{what} needs at least {gib(need)}, more than the {gib(limit.bytes)} this process may take "
            f"({limit.source}); {fix}"
        )
