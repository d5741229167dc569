"""The rendered book as a reader meets it: every page of ``_toc.yml`` opened in headless Chromium.

A page fails if
- it is not in ``_toc.yml`` (or a ``_toc.yml`` entry has no page);
- a rendered cell shows a traceback or an error output (cells tagged ``raises-exception``
  excepted: Jupyter Book puts the tag on the cell as the CSS class ``tag_raises-exception``);
- a figure does not load (an ``<img>`` with a natural size of zero);
- math is not typeset: raw LaTeX delimiters (``\\(``, ``\\[``) left in the page's text outside
  code, a math element with no MathJax output in it, or MathJax not loaded on a page with math
  (the book serves MathJax itself, sphinx-mathjax-offline: no network needed);
- an internal link is broken (no such file, or no such ``#id`` on the target page);
- its console shows a JavaScript error, other than a blocked network fetch of an offline machine
  (the theme may fetch fonts from CDNs; this test blocks every host but 127.0.0.1).

The pages are served over http://127.0.0.1 by a local http.server thread (file:// can hide
fetch errors). A screenshot of each page (its top, and the whole page in parts, however long)
goes to the pytest tmp dir and to ``_build/screenshots/``. The book is the session fixture ``built_book`` (conftest.py):
this file builds nothing itself.

Needs Debian's ``chromium`` and ``chromium-driver`` (scripts/test.sh installs them with apt-get
when it runs as root on Linux) and pip's ``selenium``. Without them the tests skip, except under
CI=true, where they fail. ``test_toc_orders_the_book`` needs neither the book nor a browser.

To rerun the page checks on a book you already built:
``MLA_BOOK_HTML=/path/to/_build/html python -m pytest tests/test_browser.py``.
"""
from __future__ import annotations

import functools
import html.parser
import http.server
import os
import pathlib
import shutil
import threading
import time
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHOTS = ROOT / "_build" / "screenshots"
PORT_HOST = "127.0.0.1"
WINDOW = (1280, 900)
PART_HEIGHT = 3000               # whole-page screenshots come in parts this tall


#: Console errors of an offline machine: a fetch of another host that could not connect.
OFFLINE_ERRORS = ("ERR_NAME_NOT_RESOLVED", "ERR_NAME_RESOLUTION_FAILED", "ERR_INTERNET_DISCONNECTED",
                  "ERR_CONNECTION_REFUSED", "ERR_ADDRESS_UNREACHABLE", "ERR_NETWORK_ACCESS_DENIED",
                  "ERR_CONNECTION_TIMED_OUT", "ERR_TIMED_OUT", "ERR_PROXY_CONNECTION_FAILED",
                  "ERR_NETWORK_CHANGED", "ERR_BLOCKED_BY_CLIENT")

# ---------------------------------------------------------------------------------------------
# The pages: _toc.yml, the sources it should list, and the HTML the build wrote.
# ---------------------------------------------------------------------------------------------


def toc_files() -> list[str]:
    """Every file of ``_toc.yml``, in reading order (root first, then parts, chapters, sections)."""
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for e in entries or []:
            if "file" in e:
                files.append(e["file"])
            walk(e.get("sections"))

    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    return [str(pathlib.PurePosixPath(f).with_suffix("")) if f.endswith((".md", ".ipynb")) else f
            for f in files]


def source_pages() -> set[str]:
    """Pages the repository has: notebooks/*.ipynb and book/*.md."""
    pages = {f"notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    return pages | {f"book/{p.stem}" for p in (ROOT / "book").glob("*.md")}


#: HTML files a Sphinx build writes that are not pages of the book.
SPHINX_PAGES = {"index.html", "genindex.html", "search.html", "py-modindex.html"}
NOT_PAGES = ("_static/", "_sources/", "_images/", "_downloads/", "_sphinx_design_static/", "reports/")


def html_pages(html: pathlib.Path) -> set[str]:
    """The pages the build rendered, as toc names (``notebooks/01_cache_layout``)."""
    out = set()
    for p in html.rglob("*.html"):
        rel = p.relative_to(html).as_posix()
        if rel in SPHINX_PAGES or rel.startswith(NOT_PAGES):
            continue
        out.add(rel[: -len(".html")])
    return out


TOC = toc_files()

# ---------------------------------------------------------------------------------------------
# Fixtures: the book, a local web server, the browser.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def html_dir(built_book) -> pathlib.Path:
    proc, html = built_book
    if not (html / "index.html").exists():
        detail = "" if proc is None else (proc.stdout[-3000:] + proc.stderr[-3000:])
        pytest.fail(f"the book did not render (no {html / 'index.html'}); the build said:\n{detail}")
    return html


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no request log on stderr
        pass


@pytest.fixture(scope="module")
def site(html_dir):
    """``http://127.0.0.1:PORT/`` serving the built HTML, from a thread of this process."""
    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer((PORT_HOST, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{PORT_HOST}:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def _find(*names):
    for n in names:
        path = shutil.which(n)
        if path:
            return path
    for n in names:
        for d in ("/usr/bin", "/usr/lib/chromium", "/usr/lib/chromium-browser"):
            if os.access(os.path.join(d, n), os.X_OK):
                return os.path.join(d, n)
    return None


def _missing(what: str):
    msg = (f"{what}. The browser test needs Debian's chromium and chromium-driver "
           "(apt-get install -y chromium chromium-driver; scripts/test.sh does it as root) "
           "and pip's selenium (requirements.txt).")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium through chromedriver, offline: every host but 127.0.0.1 fails to resolve,
    so nothing is downloaded and the offline console errors are the same on every machine."""
    chromium = _find("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    driver_path = _find("chromedriver", "chromium-driver")
    if chromium is None or driver_path is None:
        _missing(f"chromium not found (browser: {chromium}, driver: {driver_path})")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("the selenium package is not installed")

    profile = tmp_path_factory.mktemp("chromium-profile")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium      # with the driver path below: no Selenium Manager lookup
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--user-data-dir={profile}",
                f"--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE {PORT_HOST}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=driver_path, log_output=str(profile / "chromedriver.log"))
    driver = webdriver.Chrome(options=opts, service=service)
    driver.set_page_load_timeout(120)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    """Screenshot folders: the pytest tmp dir, and _build/screenshots/ (git-ignored)."""
    tmp = tmp_path_factory.mktemp("screenshots")
    if SHOTS.exists():
        for old in SHOTS.glob("*.png"):
            old.unlink()
    SHOTS.mkdir(parents=True, exist_ok=True)
    return tmp


# ---------------------------------------------------------------------------------------------
# Checks.
# ---------------------------------------------------------------------------------------------


class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k == "id" or (k == "name" and tag == "a"):
                self.ids.add(v)


@functools.lru_cache(maxsize=None)
def _ids_of(path: pathlib.Path) -> frozenset:
    parser = _Ids()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(parser.ids)


def _local_target(html: pathlib.Path, path: str) -> pathlib.Path:
    p = html / urllib.parse.unquote(path).lstrip("/")
    return p / "index.html" if path.endswith("/") or p.is_dir() else p


def broken_links(html: pathlib.Path, base: str, links: list[dict]) -> list[str]:
    """Internal links (to this site) whose file does not exist or whose #id is not on the page."""
    bad = []
    origin = urllib.parse.urlsplit(base)
    for link in links:
        raw, absolute = link["raw"], link["abs"]
        if not raw or raw.startswith(("mailto:", "javascript:", "tel:", "data:")):
            continue
        u = urllib.parse.urlsplit(absolute)
        if (u.scheme, u.netloc) != (origin.scheme, origin.netloc):
            continue                                           # an external link: not ours to check
        target = _local_target(html, u.path)
        if not target.is_file():
            bad.append(f"{raw!r} -> no file {target.relative_to(html) if html in target.parents else target}")
            continue
        frag = urllib.parse.unquote(u.fragment)
        if frag and frag != "top" and target.suffix == ".html" and frag not in _ids_of(target):
            bad.append(f"{raw!r} -> no id {frag!r} on {target.relative_to(html)}")
    return bad


def console_errors(entries: list[dict]) -> list[str]:
    """Console entries at error level, less the blocked fetches of other hosts (offline machine)."""
    bad = []
    for e in entries:
        if e.get("level") != "SEVERE":
            continue
        msg = e.get("message", "")
        url = msg.split(" ", 1)[0]
        host = urllib.parse.urlsplit(url).hostname if "://" in url else None
        if any(code in msg for code in OFFLINE_ERRORS) and host not in (None, PORT_HOST, "localhost"):
            continue
        bad.append(msg)
    return bad


# Runs in the page: wait for every <img> to finish loading, then report what the checks need.
_PAGE_JS = r"""
const done = arguments[arguments.length - 1];
const imgs = Array.from(document.images);
imgs.forEach(i => { i.loading = "eager"; });
const pending = imgs.filter(i => !i.complete).map(i => new Promise(r => {
  i.addEventListener("load", r, {once: true}); i.addEventListener("error", r, {once: true});
}));
const timeout = new Promise(r => setTimeout(r, 20000));
// MathJax typesets after load: wait for it (startup, then any typesetting still queued).
const mj = window.MathJax && window.MathJax.startup && window.MathJax.startup.promise
  ? window.MathJax.startup.promise.then(() => window.MathJax.typesetPromise ? window.MathJax.typesetPromise() : null)
  : Promise.resolve();
Promise.race([Promise.all(pending.concat([mj.catch(() => null)])), timeout]).then(() => {
  const sel = "div.output.error, div.output.traceback, .cell_output .traceback, .cell_output .ansi-traceback";
  const cells = new Set();     // one entry per cell output, however many error marks it has
  const owner = el => el.closest(".cell_output") || el;
  document.querySelectorAll(sel).forEach(el => cells.add(owner(el)));
  // An error printed as plain text (an ANSI traceback in a stream output) counts too.
  document.querySelectorAll(".cell_output").forEach(el => {
    if (el.textContent.includes("Traceback (most recent call last)")) cells.add(el);
  });
  const errors = [];
  cells.forEach(el => {
    const cell = el.closest("div.cell");
    if (cell && cell.classList.contains("tag_raises-exception")) return;
    const heading = (() => {   // the nearest section title above, to say where it is
      let s = el.closest("section");
      const h = s ? s.querySelector("h1, h2, h3") : null;
      return h ? h.textContent.replace(/[#¶]/g, "").trim() : "";
    })();
    errors.push({section: heading, text: el.textContent.trim().slice(0, 600)});
  });
  // Math: Sphinx writes \( \) and \[ \] inside span.math / div.math; MathJax replaces them
  // with mjx-container elements. Raw delimiters left in the text outside code mean it did not.
  const mathEls = Array.from(document.querySelectorAll("span.math, div.math"));
  const untypeset = mathEls.filter(el => !el.querySelector("mjx-container"))
                           .map(el => el.textContent.trim().slice(0, 80));
  const body = document.body.cloneNode(true);
  body.querySelectorAll("pre, code, script, style, .highlight, textarea").forEach(el => el.remove());
  const text = body.textContent;
  const raw = [];
  for (const d of ["\\(", "\\["]) {
    let i = text.indexOf(d);
    if (i >= 0) raw.push(text.slice(Math.max(0, i - 30), i + 50).replace(/\s+/g, " "));
  }
  done({
    title: document.title,
    math: {elements: mathEls.length, untypeset: untypeset, raw: raw,
           mathjax: !!(window.MathJax && window.MathJax.version), typeset: document.querySelectorAll("mjx-container").length},
    errors: errors,
    images: imgs.map(i => ({src: i.currentSrc || i.src, complete: i.complete,
                            w: i.naturalWidth, h: i.naturalHeight})),
    links: Array.from(document.querySelectorAll("a[href]")).map(a => ({raw: a.getAttribute("href"), abs: a.href})),
    height: Math.max(document.documentElement.scrollHeight, document.body.scrollHeight),
  });
});
"""


def screenshot(driver, name: str, height: int, folder: pathlib.Path) -> list[pathlib.Path]:
    """``name.png``: the page's top, as a reader first sees it; then the whole page, in parts of
    PART_HEIGHT pixels (``name-part-01.png``, ...; at most MAX_PARTS of them)."""
    top = folder / f"{name}.png"
    driver.save_screenshot(str(top))
    out = [top]
    driver.set_window_size(WINDOW[0], PART_HEIGHT)
    try:
        view = driver.execute_script("return window.innerHeight") or PART_HEIGHT
        for k in range(-(-height // view)):
            driver.execute_script("window.scrollTo(0, arguments[0])", k * view)
            time.sleep(0.2)
            part = folder / f"{name}-part-{k + 1:02d}.png"
            driver.save_screenshot(str(part))
            out.append(part)
    finally:
        driver.set_window_size(*WINDOW)
        driver.execute_script("window.scrollTo(0, 0)")
    for p in out:
        shutil.copy2(p, SHOTS / p.name)
    return out


# ---------------------------------------------------------------------------------------------
# Tests.
# ---------------------------------------------------------------------------------------------


def toc_parts() -> dict[str, list[str]]:
    """Part caption -> its files (chapters and sections)."""
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    parts = {}
    for part in toc.get("parts", []):
        files = []
        for ch in part.get("chapters") or []:
            files.append(ch["file"])
            files += [s["file"] for s in ch.get("sections") or []]
        parts[part.get("caption", "")] = [f.rsplit(".", 1)[0] if f.endswith((".md", ".ipynb")) else f
                                          for f in files]
    return parts


def test_toc_orders_the_book():
    """Root book/intro; the chapters' notebooks in the numbered part "Chapters", in file-name
    order; the appendix's (``notebooks/appendix_*``) in "Appendix", after them; the prose pages in
    "Using the book". (A notebook line appended at the end of _toc.yml would land among the
    prose pages: this says so.)"""
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    assert toc["root"] == "book/intro"
    parts = toc_parts()
    assert list(parts)[:1] == ["Chapters"], f"the first part must be 'Chapters', got {list(parts)}"
    assert toc["parts"][0].get("numbered") is True, "the 'Chapters' part must be numbered"
    chapters = parts["Chapters"]
    assert all(f.startswith("notebooks/") for f in chapters), f"not a notebook in 'Chapters': {chapters}"
    assert chapters == sorted(chapters), f"chapters out of file-name order: {chapters}"
    assert list(parts)[1:2] == ["Appendix"], f"the second part must be 'Appendix', got {list(parts)}"
    assert parts["Appendix"] and all(f.startswith("notebooks/appendix_") for f in parts["Appendix"])
    others = [f for cap, files in parts.items() if cap not in ("Chapters", "Appendix") for f in files]
    stray = [f for f in others if f.startswith("notebooks/")]
    assert not stray, f"notebooks outside the 'Chapters' part (append them after the last chapter): {stray}"


@pytest.mark.slow
@pytest.mark.timeout(3600)   # the first test to need the book builds it (conftest.built_book)
def test_every_page_is_in_the_toc_and_rendered(html_dir):
    toc = set(TOC)
    dupes = sorted({f for f in TOC if TOC.count(f) > 1})
    not_in_toc = sorted(source_pages() - toc)
    no_source = sorted(f for f in toc if not any((ROOT / f"{f}{ext}").exists() for ext in (".md", ".ipynb")))
    rendered = html_pages(html_dir)
    not_rendered = sorted(toc - rendered)
    stray = sorted(rendered - toc)
    problems = {"pages missing from _toc.yml": not_in_toc, "_toc.yml entries with no source": no_source,
                "_toc.yml entries listed twice": dupes, "_toc.yml entries the build did not render": not_rendered,
                "rendered pages that _toc.yml does not list": stray}
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, "\n".join(f"{k}: {v}" for k, v in problems.items())


@pytest.mark.slow
@pytest.mark.timeout(3600)   # the first test to need the book builds it (conftest.built_book)
@pytest.mark.parametrize("page", TOC)
def test_page_as_a_reader_meets_it(page, html_dir, site, browser, shots):
    target = html_dir / f"{page}.html"
    if not target.exists():
        pytest.fail(f"{page}: the build wrote no {target.name} (did the notebook fail to execute?)",
                    pytrace=False)
    url = urllib.parse.urljoin(site, f"{page}.html")
    browser.get_log("browser")                                  # drop what earlier pages left
    t0 = time.monotonic()
    browser.get(url)
    info = browser.execute_async_script(_PAGE_JS)
    time.sleep(0.3)                                             # late console messages
    log = browser.get_log("browser")
    name = page.replace("/", "-")                               # notebooks-01_cache_layout
    screenshot(browser, name, info["height"], shots)

    problems = []
    for e in info["errors"]:
        where = f" (section {e['section']!r})" if e["section"] else ""
        problems.append(f"error output in a cell{where}:\n    " + e["text"].replace("\n", "\n    "))
    for img in info["images"]:
        if not img["complete"] or img["w"] == 0 or img["h"] == 0:
            problems.append(f"figure did not load: {img['src']} (natural size {img['w']}x{img['h']})")
    problems += [f"broken internal link: {b}" for b in broken_links(html_dir, site, info["links"])]
    problems += [f"console error: {m}" for m in console_errors(log)]
    math = info["math"]
    if math["elements"] and not math["mathjax"]:
        problems.append(f"{math['elements']} math elements and no MathJax on the page")
    problems += [f"math not typeset: {t!r}" for t in math["untypeset"][:5]]
    problems += [f"raw LaTeX in the page text: ...{t}..." for t in math["raw"]]
    assert not problems, (f"{page} ({url}, {time.monotonic() - t0:.1f} s, screenshot "
                          f"_build/screenshots/{name}.png):\n" + "\n".join(f"- {p}" for p in problems))
