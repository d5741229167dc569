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


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_book_serves_mathjax_itself(built_book):
    """Every page with math loads MathJax from the book's own _static/ (sphinx-mathjax-offline),
    not from a CDN, and the file is there: math renders with no network."""
    import re

    _, html = built_book
    assert (html / "_static" / "mathjax" / "tex-chtml.js").is_file()
    with_math = 0
    for page in html.rglob("*.html"):
        text = page.read_text(encoding="utf-8", errors="replace")
        scripts = re.findall(r'<script[^>]*src="([^"]*mathjax[^"]*)"', text, flags=re.I)
        assert not [s for s in scripts if "://" in s], f"{page.name} loads MathJax from the network: {scripts}"
        if 'class="math' in text:
            with_math += 1
            assert any(s.endswith("_static/mathjax/tex-chtml.js") for s in scripts), f"{page.name}: no MathJax"
    assert with_math >= 3, f"only {with_math} pages have math"


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


def _python_blocks(page: pathlib.Path) -> list[str]:
    import re

    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


@pytest.mark.timeout(900)
def test_every_snippet_of_the_serving_page_runs():
    """The serving page's snippets, in order, in one namespace, as a reader would paste them."""
    blocks = _python_blocks(ROOT / "book" / "serving.md")
    assert len(blocks) >= 6, len(blocks)
    namespace = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"book/serving.md, snippet {i + 1}", "exec"), namespace)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"snippet {i + 1} of book/serving.md fails: {type(e).__name__}: {e}\n{code}")


def test_the_serving_pages_config_example_is_the_shipped_table():
    """The JSON example of book/serving.md is an excerpt of mla/configs/h200.json: its GPU, Triton
    version, Gluon flag and every config it shows equal the shipped file's ("measured" is
    abbreviated on the page)."""
    import json
    import re

    (block,) = re.findall(r"^```json\n(.*?)^```", (ROOT / "book" / "serving.md").read_text(), flags=re.S | re.M)
    example = json.loads(block)
    shipped = json.loads((ROOT / "mla" / "configs" / "h200.json").read_text())
    assert {k: v for k, v in example.items() if k not in ("measured", "tl_dot")} == \
        {k: shipped[k] for k in example if k not in ("measured", "tl_dot")}
    assert example["tl_dot"] and all(cfg == shipped["tl_dot"][bucket] for bucket, cfg in example["tl_dot"].items())
