import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (turns the interpreter on when there is no GPU)
import torch  # noqa: E402
from mla import layout  # noqa: E402

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def fill_with_latents(cache, gen) -> None:
    """Random N(0, 1) latents, quantized, in every page of ``cache`` (a view with the padded page
    stride, of any rank from 3 on)."""
    nb, page = cache.shape[0], cache.shape[1]
    assert cache.stride(0) == mla.page_stride(page)
    kv = torch.randn(nb, page, 512, generator=gen).bfloat16()
    layout.cache_bytes(cache).copy_(layout.cache_bytes(mla.quantize_kv(kv)).to(cache.device))


def pool_views(blocks, page, device, gen) -> list:
    """Caches as a server's pool holds its layers': ``[blocks[i], page, 584]`` uint8 views of ONE
    allocation, one after another, each with the padded page stride, filled by
    :func:`fill_with_latents`."""
    stride = mla.page_stride(page)
    pool = torch.zeros(sum(blocks) * stride, dtype=torch.uint8, device=device)
    views, at = [], 0
    for n in blocks:
        views.append(pool.as_strided((n, page, layout.TOKEN_BYTES), (stride, layout.TOKEN_BYTES, 1), at))
        fill_with_latents(views[-1], gen)
        at += n * stride
    return views


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def plans_made(monkeypatch):
    """Every plan made while the test runs, in order (``mla.api._make_plan``, which every plan,
    made by ``mla.plan``, cached or made by ``mla.flash_mla``, goes through)."""
    from mla import api

    made = []
    real = api._make_plan

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(api, "_make_plan", spy)
    return made


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
