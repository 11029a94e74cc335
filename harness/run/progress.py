"""What a cell is doing, for whoever listens: ``pf-bench run`` prints a line per system and repeat (a cell is
otherwise silent for minutes). The cell code calls :func:`report`; a caller listens with :func:`reporting`.
Nothing listens by default (sweeps, workers, ranks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["report", "reporting"]

_LISTENER: ContextVar[Callable[[str], None] | None] = ContextVar("pf_bench_progress", default=None)


def report(message: str) -> None:
    listener = _LISTENER.get()
    if listener is not None:
        listener(message)


@contextmanager
def reporting(listener: Callable[[str], None]) -> Iterator[None]:
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)
