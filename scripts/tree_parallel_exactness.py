"""The worst loss and gradient error per parallel layout of tests/prefixflow/tree/test_tree_parallel.py.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/tree_parallel_exactness.py

One launch of two local ranks (loopback only); prints, per layout, the worst ``max|d| / max|ref|`` over every
gradient and the loss's relative error against one process training the same trees with the baseline.
"""

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.torchrun_cases import launch_cases  # noqa: E402

results = launch_cases(
    REPO / "tests/prefixflow/tree/test_tree_parallel.py", 2, Path(tempfile.mkdtemp()) / "out.json"
)
by_layout: dict[str, list[tuple[float, float]]] = {}
for name, result in results.items():
    if "grad_rel" in result:
        by_layout.setdefault(name.split("-")[0], []).append((result["grad_rel"], result["loss_rel"]))
print("| layout | cases | worst gradient | worst loss |\n|---|---|---|---|")
for layout, errors in by_layout.items():
    grad, loss = max(e[0] for e in errors), max(e[1] for e in errors)
    print(f"| {layout} | {len(errors)} | {grad:.1e} | {loss:.1e} |")
