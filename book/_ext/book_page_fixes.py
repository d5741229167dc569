"""Small Sphinx fixes for how the rendered pages behave in a browser (loaded from _config.yml,
``sphinx.local_extensions``). tests/test_browser.py fails on any JavaScript console error; these
remove the ones Jupyter Book 1.x's own stack causes:

- Inline ``<script>`` blocks that extensions register (sphinx-thebe's
  ``const THEBE_JS_URL = ...``, sphinx-togglebutton's selector) come out twice in every page:
  once through Sphinx's asset registry and once through the builder. A second ``const``
  declaration is a SyntaxError in the reader's console. Drop the exact duplicates.
"""
from __future__ import annotations

import os


def _key(js):
    filename = getattr(js, "filename", js)
    attrs = getattr(js, "attributes", {}) or {}
    return os.fspath(filename or ""), tuple(sorted((k, str(v)) for k, v in attrs.items()))


def drop_duplicate_scripts(app, pagename, templatename, context, doctree):
    files = context.get("script_files")
    if not files:
        return
    seen, kept = set(), []
    for js in files:
        k = _key(js)
        if k not in seen:
            seen.add(k)
            kept.append(js)
    files[:] = kept          # the builder restores its list before the next page


def setup(app):
    app.connect("html-page-context", drop_duplicate_scripts, priority=900)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
