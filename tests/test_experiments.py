"""Every module in experiments/ still imports against the package: each probe script prints its
usage with ``--help`` and exits 0 without a GPU (the work sits under ``__main__``), and the
library modules (no ``__main__``) import in-process."""
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import DEVICE

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
#: modules that other code imports (tests, notebooks), not scripts: no ``__main__``, no ``--help``
LIBRARIES = ("broken_decodes", "autotune_demos", "autotune_mla")
SCRIPTS = sorted(p.stem for p in EXPERIMENTS.glob("*.py") if p.stem != "__init__" and p.stem not in LIBRARIES)


def test_the_lists_cover_the_folder():
    assert SCRIPTS, "no probe scripts found in experiments/"
    for name in LIBRARIES:
        assert (EXPERIMENTS / f"{name}.py").is_file(), name


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help(name):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, f"experiments/{name}.py", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"experiments/{name}.py --help exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip(), f"experiments/{name}.py --help printed nothing"
    assert "usage:" in r.stdout, r.stdout


@pytest.mark.parametrize("name", LIBRARIES)
def test_library_imports(name):
    mod = importlib.import_module(f"experiments.{name}")
    assert mod.__doc__


def test_the_gpu_validations_bf16_variant_reaches_the_kernel(monkeypatch):
    """scripts/gpu_validation.py's "mma-bf16" probe launches the tl.dot kernel with bf16 operands
    (its plan's launches hold the constexprs it changes), not the shipped fp16 ones."""
    import triton.language as tl

    from mla import dispatch
    from mla.validate import make_case

    gv = _gpu_validation()
    seen = []

    class Recording:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw)

    monkeypatch.setattr(dispatch.tl_dot, "tl_dot_decode_kernel", Recording())
    c = make_case(b=1, s_q=1, h_q=4, topk=16, page=16, sink=False, seed=1, device=DEVICE)
    gv._bf16_operands(c["q"], c["k_cache"], c["indices"])
    assert seen and all(kw["DOT"] is tl.bfloat16 for kw in seen)


def _gpu_validation():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_validation", ROOT / "scripts" / "gpu_validation.py")
    gv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gv)
    return gv


def test_the_gpu_validation_refuses_an_unknown_impl(capsys):
    with pytest.raises(SystemExit) as e:
        _gpu_validation().main(["--impls", "mma-tl,nonsense", "--device", "cpu"])
    assert e.value.code == 2
    assert "--impls: nonsense" in capsys.readouterr().err


def test_the_gpu_validation_runs_only_the_named_impls(tmp_path):
    """--impls: the counted rows are those impls' only, and the summary says which ran."""
    import json

    rc = _gpu_validation().main(["--quick", "--device", "cpu", "--impls", "reference,mma-tl", "--workers", "1",
                                 "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "validation.json").read_text())
    assert doc["summary"]["impls"] == ["reference", "mma-tl"]
    assert {r["impl"] for r in doc["records"]} == {"reference", "mma-tl"}
    assert rc == 0 and doc["summary"]["failures"] == 0


def test_the_gpu_validation_runs_v32_cases_on_every_impl_but_the_gluon_ones():
    """The Gluon kernel reads the MODEL1 cache only: its forced impls skip DeepSeek-V3.2's cases
    (no row, no error), every other impl runs them; MODEL1's cases run every impl."""
    import dataclasses
    import time

    import mla.validate as mv

    gv = _gpu_validation()
    v32, model1 = mv.v32_cases()[0], mv.odd_cases()[0]
    assert gv.impls_for(v32, gv.COUNTED) == tuple(n for n in gv.COUNTED if n not in gv.GLUON)
    assert gv.impls_for(model1, gv.COUNTED) == gv.COUNTED
    tiny = dataclasses.replace(v32, b=1, s_q=1, h_q=2, topk=24, page=8, num_blocks=None)
    rows, skipped = gv._work(([dataclasses.asdict(tiny)], ("reference", "mma-wgmma", "mma-tl"), time.time() + 600,
                              False, 0, "cpu"))
    assert not skipped and [r["impl"] for r in rows] == ["reference", "mma-tl"]
    assert all(r["ok"] for r in rows), rows
