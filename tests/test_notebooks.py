"""papermill executes every notebook in notebooks/ and fails on any error."""
import pathlib

import pytest
import torch

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(nb, tmp_path):
    import papermill as pm

    params = {} if torch.cuda.is_available() else {"SMALL": True}
    pm.execute_notebook(str(nb), str(tmp_path / nb.name), kernel_name="python3",
                        parameters=params, cwd=str(nb.parent), execution_timeout=1500,
                        progress_bar=False)


def test_every_notebook_has_a_parameters_cell_and_no_outputs():
    import nbformat

    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: expected one cell tagged 'parameters'"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs, f"{path.name}: committed with outputs"
