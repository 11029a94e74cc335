"""notebooks/capacity_frontier.ipynb runs headless (nbclient) on a synthetic results folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # the [test] extra; the lent GPU machine has none of these
pytest.importorskip("nbclient")
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel  # noqa: E402
from nbclient import NotebookClient  # noqa: E402
from support import REPO  # noqa: E402

from harness.records import write_records  # noqa: E402

NOTEBOOK = REPO / "notebooks" / "capacity_frontier.ipynb"
MIB = 1024**2


def _kernel_name(tmp_path: Path, monkeypatch) -> str:
    """``python3`` when it resolves to this interpreter's ipykernel; else a kernelspec made for it."""
    try:
        argv = KernelSpecManager().get_kernel_spec("python3").argv
        # jupyter_client swaps a bare "python" for sys.executable when it launches the kernel
        if argv and (
            argv[0] in ("python", "python3") or Path(argv[0]).resolve() == Path(sys.executable).resolve()
        ):
            return "python3"
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    prefix = tmp_path / "jupyter"
    install(kernel_name="pf-test", prefix=str(prefix))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    return "pf-test"


def _write_results(root: Path, budget: float) -> None:
    """Frontier probes for three variants (one Parquet file each) plus an unrelated speed record."""
    root.mkdir(parents=True)
    for system, off, per_tok in (
        ("baseline", False, 0.4),
        ("prefixflow", False, 0.3),
        ("prefixflow", True, 0.2),
    ):
        rows = []
        for i, total in enumerate((1024, 1536, 2048, 2560, 3072)):
            P = total * 5 // 6
            peak = per_tok * total * MIB
            rows.append({
                "cell_id": f"{system}-{off}-{i}", "spec": "claim4-frontier", "timestamp": f"2026-01-01T00:00:0{i}",
                "system": system, "offload": off, "prefix_len": P, "suffix_len": total - P, "n": 8,
                "status": "ok" if peak <= budget else "oom", "peak_mem_bytes": peak,
                "budget_bytes": budget, "probe": i, "mem_meter": "cpu-live-bytes",
                "search_id": f"frontier-{system}-{off}",
            })  # fmt: skip
        write_records(root / f"frontier-{system}-{off}.parquet", rows)
    speed = {
        "cell_id": "x",
        "spec": "claim3",
        "timestamp": "2026-01-01T00:00:00",
        "system": "baseline",
        "offload": False,
        "prefix_len": 64,
        "suffix_len": 64,
        "n": 2,
        "status": "ok",
        "step_time_s": 1.0,
    }
    write_records(root / "x.parquet", [speed])


def _run(tmp_path: Path, monkeypatch, params: str) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(idx + 1, nbformat.v4.new_code_cell(params, metadata={"tags": ["injected-parameters"]}))
    client = NotebookClient(
        nb, timeout=120, kernel_name=_kernel_name(tmp_path, monkeypatch),
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )  # fmt: skip
    client.execute()
    return nb


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")))
    return "\n".join(out)


def test_notebook_runs_and_finds_the_frontier(tmp_path, monkeypatch):
    results, figs = tmp_path / "results", tmp_path / "figs"
    _write_results(results, budget=512 * MIB)
    nb = _run(tmp_path, monkeypatch, f"ESTIMATE = False\nRESULTS_DIR = {str(results)!r}\nOUT_DIR = {str(figs)!r}\nSPLIT = 5/6")
    text = _text(nb)
    assert "16 records, 15 frontier probes" in text
    assert "budget: 0.500 GiB" in text
    assert "prefixflow+offload:    2560 tokens  (2.50x baseline)" in text
    assert "baseline:    1024 tokens  (1.00x baseline)" in text
    png = figs / "capacity_frontier_notebook.png"
    assert png.stat().st_size > 5000


def test_notebook_rereads_probes_under_a_tighter_budget(tmp_path, monkeypatch):
    results = tmp_path / "results"
    _write_results(results, budget=512 * MIB)
    nb = _run(tmp_path, monkeypatch, f"ESTIMATE = False\nRESULTS_DIR = {str(results)!r}\nBUDGET_BYTES = {420 * MIB}")
    text = _text(nb)
    # 420 MiB: baseline fits 1024 (409.6 MiB), offload fits 2048 (409.6 MiB) but not 2560 (512 MiB)
    assert "budget: 0.410 GiB" in text
    assert "prefixflow+offload:    2048 tokens  (2.00x baseline)" in text
    assert "prefixflow:    1024 tokens  (1.00x baseline)" in text


def test_notebook_estimates_the_frontier_of_the_chosen_model_budget_and_layout(tmp_path, monkeypatch):
    """Tab 1 on a tiny model: its frontier is the one its own estimated probes give (kept under
    ESTIMATE_OUT, where ``pf-bench frontier`` would keep them), and Tab 2 still reads the CPU records."""
    from harness.figures.fig10 import frontier_table
    from harness.records import collect

    results, est = tmp_path / "results", tmp_path / "estimates"
    _write_results(results, budget=512 * MIB)
    tiny = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "vocab_size": 64}
    params = (
        f"ESTIMATE = True\nMODEL = 'llama3:debugmodel'\nOVERRIDES = {tiny!r}\nBUDGET = '16MiB'\nLAYOUT = {{}}\n"
        f"MIN_LEN, MAX_LEN, RESOLUTION = 256, 2048, 256\nDTYPE, AC = 'fp32', 'none'\nJOBS = 2\n"
        f"ESTIMATE_OUT = {str(est)!r}\nRESULTS_DIR = {str(results)!r}\nOUT_DIR = {str(tmp_path / 'figs')!r}"
    )
    text = _text(_run(tmp_path, monkeypatch, params))
    _, front, _ = frontier_table(collect(est / "frontier"), budget=16 * MIB)
    best = dict(zip(front["variant"], front["max_total"], strict=True))
    assert set(best) == {"baseline", "prefixflow+offload"} and 0 < best["baseline"] < best["prefixflow+offload"]
    for variant, total in best.items():
        assert f"{variant:>20}: {total:>7} tokens" in text
    assert "llama3:debugmodel on single, 0.02 GiB per rank, estimated" in text
    assert (tmp_path / "figs" / "capacity_frontier_estimated.png").stat().st_size > 5000
    assert "prefixflow+offload:    2560 tokens  (2.50x baseline)" in text  # Tab 2, the CPU records
