"""The book builds with warnings as errors (it executes every notebook). The build itself is the
session fixture ``built_book`` in conftest.py, shared with test_browser.py."""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_book_builds_without_warnings(built_book):
    proc, html = built_book
    if proc is None:
        pytest.skip(f"MLA_BOOK_HTML is set: reusing the book at {html}, not building it")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert (html / "index.html").exists()


def test_toc_lists_every_notebook_and_page():
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = {toc["root"]}
    for part in toc.get("parts", []):
        for ch in part["chapters"]:
            files.add(ch["file"])
            files.update(s["file"] for s in ch.get("sections", []))
    pages = {f"notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    pages |= {f"book/{p.stem}" for p in (ROOT / "book").glob("*.md")}
    assert pages == files, f"not in _toc.yml: {sorted(pages - files)}; missing files: {sorted(files - pages)}"
