import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (turns the interpreter on when there is no GPU)
import torch  # noqa: E402

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(scope="session")
def built_book(tmp_path_factory):
    """Build the book once per session (warnings as errors, every notebook executed) and return
    ``(completed process, html folder)``. test_book.py checks the build, test_browser.py opens
    its pages.

    Set MLA_BOOK_HTML to an existing ``_build/html`` folder to reuse that build instead (then the
    process is None and the build test skips): a quick way to rerun the page checks."""
    reuse = os.environ.get("MLA_BOOK_HTML")
    if reuse:
        return None, pathlib.Path(reuse).resolve()
    out = tmp_path_factory.mktemp("book")
    jb = pathlib.Path(sys.executable).with_name("jupyter-book")
    cmd = [str(jb), "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3000)
    return proc, out / "_build" / "html"
