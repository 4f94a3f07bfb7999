"""The notebooks run top to bottom, as a reader runs them, and are committed without outputs.

Each notebook is executed with nbclient in a fresh kernel of *this* interpreter (a kernelspec
written to a temp dir pointing at ``sys.executable``, so the kernel sees the same venv and
the editable install), from a temp working directory, with the real traces, the real
simulator and (sim_vs_real) the real MLX engine on CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = ("prefer_prefill_victims", "sim_vs_real", "one_model_three_machines")
CELL_TIMEOUT_S = 300
KERNEL = "schedlab-test-python"


def _kernel_manager(tmp: Path) -> KernelManager:
    spec_dir = tmp / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "schedlab test kernel",
                "language": "python",
            }
        )
    )
    ksm = KernelSpecManager(kernel_dirs=[str(tmp / "kernels")])
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=ksm)


def test_all_notebooks_present():
    found = sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb"))
    assert found == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "a notebook with no code"
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, f"cells {dirty} have outputs or an execution count: clear them before committing"


@pytest.mark.parametrize("name", NOTEBOOKS)
@pytest.mark.slow
def test_runs_top_to_bottom(name, tmp_path):
    nb = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    # first, a probe cell: the kernel must be this interpreter (same venv, same packages)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    work = tmp_path / "work"
    work.mkdir()
    client = NotebookClient(
        nb, km=_kernel_manager(tmp_path), timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(work)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    probe = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.output_type == "stream")
    assert probe.strip() == sys.executable

    errors = [
        (i, o.get("ename"))
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "error"
    ]
    assert not errors
    unrun = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, f"cells {unrun} did not run"
    images = sum(
        1
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {})
    )
    assert images >= 2, f"{name}: expected its figures inline, got {images} image(s)"
    tracebacks = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "stream" and o.name == "stderr" and "Traceback" in o.text
    ]
    assert not tracebacks, f"cells {tracebacks} printed a traceback on stderr"
