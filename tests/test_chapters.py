"""The book's rules, read from its sources (no build, no kernel run):

- every chapter opens the same way: its title and story, a one-line pointer to "Running the book
  yourself", the papermill ``parameters`` cell, the folded ``bookpage`` set-up cell;
- no notebook defines page helpers of its own: they live in ``notebooks/bookpage.py``;
- a chapter's prose stays within about 4,500 words (the appendix excepted);
- run tags, version tags, commit hashes and probe-file names appear only in the appendix;
- no chapter types a ceiling: bandwidths, matmul rates and the ridge come from
  ``bookpage.ceilings()`` and are glued into the prose;
- at least 80% of the code cells that glue numbers into the prose fold away (``hide-input``);
- no page says the record beat FlashMLA at "12 of 12" shapes (it ran at nine of them);
- chapters 4 and 5 have their pictures (the tile's chain; the tuning cost under two keys);
- no page, notebook or the README says "lease" (the lab's word for a session on a machine);
- ``bookpage.source()`` listings keep the code's own line breaks;
- the introduction opens with the sweep's heatmap and the version ladder (``bookpage.version_ladder``,
  which reads the version log and the record);
- the sweep's shared table and heatmap (``bookpage.sweep_ratios``, ``sweep_heatmap``) read
  ``results/h200/sweep.json`` as the chapters quote it.
"""
from __future__ import annotations

import ast
import pathlib
import re
import sys

import matplotlib
import nbformat
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))

import bookpage  # noqa: E402

CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
APPENDIX = sorted(NOTEBOOKS.glob("appendix_*.ipynb"))
PAGES = sorted((ROOT / "book").glob("*.md"))
MAX_WORDS = 4500

#: page plumbing a notebook must take from bookpage, not define: its API and the old copies' names
PAGE_HELPERS = set(bookpage.__all__) | {"WrappedCode", "Source", "_repr_html_", "hang"}

#: what belongs to the lab history (the appendix) and nowhere else in the prose
LAB_TAGS = {
    "run tag": re.compile(r"\br\d{1,2}[a-h]?\b"),
    "version tag": re.compile(r"\bv\d{1,2}[a-f]?\b"),
    "commit hash": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "probe file": re.compile(r"\b\w+_(?:r|v)\d+[a-z]?\.json\b"),
}
#: a number typed in front of a ceiling's unit
TYPED_CEILING = re.compile(r"\d[\d.,]*\s*(?:TB/s|GB/s|TFLOP/s|FLOP/byte|FLOP per byte)")


def _cells(path, kind):
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == kind]


def _prose(path) -> str:
    return "\n\n".join(c.source for c in _cells(path, "markdown"))


def _ids(paths):
    return [p.stem for p in paths]


def test_the_book_has_its_chapters_and_appendix():
    assert [p.stem[:2] for p in CHAPTERS] == [f"{k:02d}" for k in range(1, len(CHAPTERS) + 1)]
    assert len(CHAPTERS) == 7 and len(APPENDIX) == 1


@pytest.mark.parametrize("path", CHAPTERS + APPENDIX, ids=_ids(CHAPTERS + APPENDIX))
def test_every_chapter_opens_the_same_way(path):
    cells = nbformat.read(path, as_version=4).cells
    title, pointer, params, setup = cells[:4]
    assert title.cell_type == "markdown" and title.source.startswith("# "), "cell 1: the title"
    assert len(title.source.split()) > 12, "cell 1: the title, then the chapter's story in a few lines"
    assert pointer.cell_type == "markdown" and "{doc}`../book/running`" in pointer.source, \
        "cell 2: the one-line pointer to book/running"
    assert len(pointer.source.splitlines()) == 1, "cell 2 is one line: the SMALL paragraph lives on book/running"
    assert params.cell_type == "code" and "parameters" in params.metadata.get("tags", []), "cell 3: parameters"
    assert params.source.strip().startswith("SMALL = None"), "cell 3: SMALL = None"
    assert setup.cell_type == "code" and "hide-input" in setup.metadata.get("tags", []), "cell 4: folded set-up"
    assert "from bookpage import *" in setup.source and "setup(SMALL)" in setup.source, "cell 4: bookpage's setup"


@pytest.mark.parametrize("path", CHAPTERS + APPENDIX, ids=_ids(CHAPTERS + APPENDIX))
def test_no_notebook_defines_page_helpers(path):
    defined = []
    for cell in _cells(path, "code"):
        code = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in PAGE_HELPERS:
                defined.append(node.name)
    assert not defined, f"{path.name} defines page helpers that live in notebooks/bookpage.py: {defined}"


@pytest.mark.parametrize("path", CHAPTERS, ids=_ids(CHAPTERS))
def test_a_chapter_stays_within_its_word_budget(path):
    words = len(_prose(path).split())
    assert words <= MAX_WORDS, f"{path.name}: {words} words of prose (at most about 4,500)"


@pytest.mark.parametrize("path", CHAPTERS + PAGES, ids=_ids(CHAPTERS + PAGES))
def test_lab_history_only_in_the_appendix(path):
    text = _prose(path) if path.suffix == ".ipynb" else path.read_text()
    found = {kind: sorted(set(rx.findall(text))) for kind, rx in LAB_TAGS.items()}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"{path.name} names lab history (it belongs in the appendix): {found}"


@pytest.mark.parametrize("path", CHAPTERS + PAGES, ids=_ids(CHAPTERS + PAGES))
def test_no_chapter_types_a_ceiling(path):
    text = _prose(path) if path.suffix == ".ipynb" else path.read_text()
    typed = sorted(set(TYPED_CEILING.findall(text)))
    assert not typed, f"{path.name} types ceilings into its prose (compute them with ceilings(), then glue): {typed}"


#: lab history named in a code cell: a probe or sweep file, or a version tag in quotes
CODE_LAB_TAGS = re.compile(r"\b\w+_(?:r|v)\d+[a-z]?\.json\b|[\"']v\d{1,2}[a-f]?\b|\bncu_r\d+")


@pytest.mark.parametrize("path", CHAPTERS, ids=_ids(CHAPTERS))
def test_code_that_names_lab_history_is_folded(path):
    """A chapter's cell may read a probe by its file name or a version of the log by its tag, but
    folded (``hide-input``): the page shows what it computes, the tags stay in the appendix."""
    shown = [c.source.splitlines()[0][:80] for c in _cells(path, "code")
             if CODE_LAB_TAGS.search(c.source)
             and not {"hide-input", "remove-input", "remove-cell"} & set(c.metadata.get("tags", []))]
    assert not shown, f"{path.name}: cells that name lab history, not folded: {shown}"


def test_the_sweep_helpers_read_the_record():
    """``bookpage.sweep_ratios``: one row per sweep point where the impl and FlashMLA were both
    timed, the ratio of the two, padded exactly below 64 heads (FlashMLA's rows say so);
    ``bookpage.sweep_heatmap``: one panel per (h_q, s_q) at full heads, one for the padded points,
    and the colour bar."""
    doc = bookpage.load("sweep.json")
    fm = {(r["shape"], r["b"], r["s_q"], r["h_q"]): r for r in doc["records"] if r["impl"] == "flashmla"}
    for impl in ("mma", "tl_dot"):
        df = bookpage.sweep_ratios(impl, doc)
        ours = [r for r in doc["records"] if r["impl"] == impl and (r["shape"], r["b"], r["s_q"], r["h_q"]) in fm]
        assert len(df) == len(ours) > 0
        assert (df["ratio"] == df["ours us"] / df["FlashMLA us"]).all()
        assert (df["padded"] == (df["h_q"] < 64)).all()
        assert set(df["config"]) <= set(bookpage.SWEEP_CONFIG_NAMES.values())
        fig = bookpage.sweep_heatmap(impl, doc)
        full = df[~df["padded"]]
        panels = len(set(zip(full["h_q"], full["s_q"]))) + bool(df["padded"].any())
        assert len(fig.axes) == panels + 1, [ax.get_title() for ax in fig.axes]
        plt.close(fig)


def test_the_code_that_glues_numbers_folds_away():
    glue_cells = [c for path in CHAPTERS for c in _cells(path, "code") if "glue(" in c.source]
    folded = [c for c in glue_cells if "hide-input" in c.metadata.get("tags", [])]
    assert glue_cells and len(folded) >= 0.8 * len(glue_cells), f"{len(folded)} of {len(glue_cells)} folded"


@pytest.mark.parametrize("path", CHAPTERS + APPENDIX + PAGES + [ROOT / "README.md"],
                         ids=_ids(CHAPTERS + APPENDIX + PAGES) + ["README"])
def test_no_page_claims_twelve_of_twelve(path):
    text = path.read_text()
    assert not re.search(r"\b12 of (the )?12\b", text), f"{path.name} says '12 of 12'"


@pytest.mark.parametrize("stem", ["04_hopper_gluon", "05_autotuner_pitfalls"])
def test_the_chapters_draw_their_pictures(stem):
    """A chapter's picture is a plotting cell: chapter 4's tile chain, chapter 5's tuning cost."""
    (path,) = [p for p in CHAPTERS if p.stem == stem]
    plots = [c.source for c in _cells(path, "code") if "plt.subplots" in c.source or "plt.figure" in c.source]
    assert plots, f"{path.name} draws no figure"


#: the lab's word for a session on a machine; the pages say machine, run, session or date
LEASE = re.compile(r"\bleas(?:e|es|ed|ing)\b", re.I)
WORDED_FILES = sorted({*(ROOT / "book").rglob("*.md"), *(ROOT / "book").rglob("*.py"), *NOTEBOOKS.glob("*.ipynb"),
                       *NOTEBOOKS.glob("*.py"), ROOT / "README.md"})


@pytest.mark.parametrize("path", WORDED_FILES, ids=[str(p.relative_to(ROOT)) for p in WORDED_FILES])
def test_no_page_says_lease(path):
    """Not in prose, code, comments or captions: a notebook is read whole, every cell."""
    found = [line.strip()[:100] for line in path.read_text().splitlines() if LEASE.search(line)]
    assert not found, f"{path.name} says 'lease': {found}"


def test_lease_check_catches_the_word_and_spares_release():
    assert LEASE.search("timed on another lease") and LEASE.search("two Leases") and not LEASE.search("release it")


def test_source_listings_keep_the_codes_line_breaks():
    """A listing's HTML holds the code's lines, no more and no fewer, and does not wrap them:
    a line longer than the page scrolls inside the listing."""
    import html

    code = ("def f(a, b):\n    x = a + b" + " + a" * 40 + "  # a line far longer than the page's 78 characters\n"
            "\n    return x\n")
    out = bookpage._Source(code)._repr_html_()
    text = html.unescape(re.sub(r"<[^>]+>", "", out))
    assert text.strip("\n").splitlines() == code.strip("\n").splitlines()
    assert "pre-wrap" not in out and "white-space: pre;" in out and "overflow-x: auto" in out


def test_the_version_ladder_reads_the_log_and_the_record():
    """One row per step (the time of the step's last version that timed the shape), then the
    record's impl='mma', then FlashMLA of the record's run."""
    log = bookpage.load("mma_versions.json")
    by_tag = {v["version"].split()[0]: v for v in log["versions"]}
    ladder = bookpage.version_ladder()
    steps = [s for s, _ in bookpage.LADDER_STEPS]
    assert list(ladder["step"]) == steps + [bookpage.LADDER_NOW, bookpage.LADDER_FLASHMLA]
    mma = {(r["shape"], r["b"]): r["us_graph"] for r in bookpage.record()["records"] if r["impl"] == "mma"}
    flash, _ = bookpage.flashmla_us()
    for name, b in bookpage.LADDER_SHAPES:
        col = ladder[f"{name} b = {b}"]
        for k, (_, tags) in enumerate(bookpage.LADDER_STEPS):
            timed = [by_tag[t]["us"][f"{name} b{b}"] for t in tags if f"{name} b{b}" in by_tag[t]["us"]]
            assert (col[k] == timed[-1]) if timed else col.isna()[k], (name, b, k)
        assert col.iloc[-2] == mma[(name, b)] and col.iloc[-1] == flash[(name, b)]
    assert ladder.iloc[0]["DSA b = 128"] == by_tag["v0"]["us"]["DSA b128"]


def test_the_intro_opens_with_the_ladder():
    """book/intro.md is a MyST notebook whose first shown cells draw the sweep's heatmap and the
    version ladder, before the story's first section."""
    text = (ROOT / "book" / "intro.md").read_text()
    assert text.startswith("---\njupytext:") and "kernelspec:" in text.split("---")[1]
    cells = re.findall(r"```\{code-cell\} ipython3\n(?::tags: \[([\w-]+)\]\n)?(.*?)```", text, flags=re.S)
    shown = [(text.index(src), src) for tags, src in cells if tags != "remove-cell"]
    assert "sweep_heatmap(" in shown[0][1] and "version_ladder()" in shown[1][1]
    assert shown[1][0] < text.index("\n## ")
