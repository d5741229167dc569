"""scripts/flashmla_tests.py, the runner of FlashMLA's own test files against mla: how it reads a
test file's case lists, which failures it counts as mla's refusals, its stand-in package, and (with
FLASHMLA_DIR set to a FlashMLA checkout) one case of each suite end to end."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

import mla.flash_mla
from mla.layout import fail

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "flashmla_tests.py"
_spec = importlib.util.spec_from_file_location("flashmla_tests", SCRIPT)
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)


def test_the_main_blocks_assignments_only(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("x = 1\nif __name__ == '__main__':\n    device = 'cuda'\n    set_up(device)\n"
                 "    cases = [x + i for i in range(3)]\n    for c in cases:\n        run(c)\n    testcases = cases\n")
    got = runner.main_block_assignments(f)
    namespace = {"x": 10}
    for stmt in got:
        exec(compile(__import__("ast").Module([stmt], []), str(f), "exec"), namespace)
    assert namespace["testcases"] == [10, 11, 12] and namespace["device"] == "cuda"
    assert "run" not in namespace and "set_up" not in namespace


def test_refusals_are_mlas_value_errors_only():
    def refuse():
        fail("q", "head dim 576 is not served")

    def other():
        raise ValueError("kernelkit: no kernel name matched")
    for fn, want in ((refuse, True), (other, False)):
        try:
            fn()
        except ValueError as e:
            assert runner.refused_by_mla(e) is want
    assert not runner.refused_by_mla(AssertionError("a FlashMLA check"))


def test_the_stand_in_package_is_mlas(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = sys.modules.pop("flash_mla", None)
    try:
        runner.install_stand_in(tmp_path)
        import flash_mla
        assert flash_mla.__file__.startswith(str(tmp_path))
        assert flash_mla.flash_mla_sparse_fwd is mla.flash_mla.flash_mla_sparse_fwd
        assert flash_mla.flash_mla_with_kvcache is mla.flash_mla.flash_mla_with_kvcache
        assert flash_mla.get_mla_metadata is mla.flash_mla.get_mla_metadata
    finally:
        sys.modules.pop("flash_mla", None)
        if saved is not None:
            sys.modules["flash_mla"] = saved


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("suite", ["prefill", "decode"])
def test_one_case_of_each_suite_end_to_end(suite, tmp_path):
    folder = os.environ.get("FLASHMLA_DIR")
    if not folder or not (pathlib.Path(folder) / "tests" / "lib.py").exists():
        pytest.skip("set FLASHMLA_DIR to a FlashMLA checkout")
    out = tmp_path / "summary.json"
    p = subprocess.run([sys.executable, str(SCRIPT), folder, "--suite", suite, "--small", "--limit", "1", "--out",
                        str(out)], capture_output=True, text=True, timeout=850, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    # the decode's first case is a V3.2 one (d_qk 576), which mla's decode refuses
    assert (s["cases_run"], s["passed"] + s["refused"], s["failed"]) == (1, 1, 0) and s["cases_listed"] > 100
    assert s["passed"] == 1 or "576" in s["refused_reasons"][0]
    assert s["mla_commit"] and s["device"] and s["flashmla"]["test_file"].startswith("tests/test_flash_mla_sparse")
