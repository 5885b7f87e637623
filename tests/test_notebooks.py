"""Every notebook in notebooks/ runs top to bottom in a real Jupyter kernel without an error.

The kernel is this interpreter (a kernelspec written to a temporary JUPYTER_PATH points at
sys.executable), so the notebooks see the same tilefuse as the tests. Needs the `notebooks`
extra (nbclient, nbformat, ipykernel, matplotlib); skipped with the reason when it is missing."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "tilefuse-test"
CELL_TIMEOUT_S = 600


def _missing() -> str | None:
    import importlib.util
    names = [n for n in ("nbclient", "nbformat", "ipykernel", "matplotlib")
             if importlib.util.find_spec(n) is None]
    if names:
        return (f"{', '.join(names)} not installed: `pip install -e .[notebooks]` "
                "(nbclient nbformat ipykernel matplotlib) to run the notebooks")
    return None


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernelspec named KERNEL that launches this interpreter, found through JUPYTER_PATH."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    home = tmp_path_factory.mktemp("jupyter")
    spec = home / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tilefuse (tests)", "language": "python",
        "env": {"MPLBACKEND": "agg", "IPYTHONDIR": str(home / "ipython")}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join([str(home), os.environ.get("JUPYTER_PATH", "")]))
        yield


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names[:4] == ["01_quickstart.ipynb", "02_fusion.ipynb", "03_backends.ipynb",
                         "04_training.ipynb"], names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"])
             if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_env):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S, allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as err:  # the message holds the failing cell and its traceback
        pytest.fail(f"{path.name} failed:\n{err}", pytrace=False)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), f"{path.name}: not every cell ran"
