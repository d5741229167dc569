"""JupyterLab opens the chapters: the README's "GPU box" section, checked headless.

The test starts ``jupyter lab`` (from ``requirements.txt``) on a free local port with a random
token and the repository as its root, waits until the server answers, fetches a chapter's page
and the notebook through the contents API, and stops the server. No browser, no kernel: a
notebook's page and its JSON are what a reader's browser would ask for first.
"""
from __future__ import annotations

import json
import os
import pathlib
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import nbformat
import pytest

pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (it is in requirements.txt: "
                                         "bash scripts/setup.sh installs it)")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTER = "notebooks/01_cache_layout.ipynb"
START_TIMEOUT_S = 25          # the server answers in a few seconds on a 2-core machine


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, token: str, timeout: float = 10.0):
    """(HTTP status, body bytes, content type) of a GET with the token in the header."""
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("Content-Type", "")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A headless JupyterLab server on the repository: yields (base URL, token); always stopped."""
    tmp = tmp_path_factory.mktemp("jupyter_lab")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ,
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),       # its connection files, not ~/.local
               JUPYTER_CONFIG_DIR=str(tmp / "config"),         # no user config changes what it serves
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               JUPYTER_PLATFORM_DIRS="1")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={ROOT}",
           "--ServerApp.terminals_enabled=False",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"]                  # asks no package index
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")                                  # CI and containers run as root
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"jupyter lab exited with {proc.returncode} before answering:\n{log.read()[-3000:]}")
            try:
                status, _, _ = _get(f"{base}/api/status", token, timeout=2)
                if status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"jupyter lab did not answer within {START_TIMEOUT_S} s:\n{log.read()[-3000:]}")
            time.sleep(0.25)
        yield base, token
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()


@pytest.mark.timeout(60)
def test_jupyter_lab_serves_a_chapters_page(lab):
    base, token = lab
    status, body, ctype = _get(f"{base}/lab/tree/{CHAPTER}", token)
    assert status == 200, f"/lab/tree/{CHAPTER}: HTTP {status}"
    assert ctype.startswith("text/html"), ctype
    page = body.decode("utf-8", "replace")
    assert "jupyter-config-data" in page, "not JupyterLab's page: its config block is missing"


@pytest.mark.timeout(60)
def test_jupyter_lab_serves_the_notebook_through_the_contents_api(lab):
    base, token = lab
    status, body, ctype = _get(f"{base}/api/contents/{CHAPTER}?type=notebook&content=1", token)
    assert status == 200, f"/api/contents/{CHAPTER}: HTTP {status}: {body[:300]!r}"
    assert ctype.startswith("application/json"), ctype
    model = json.loads(body)
    assert model["type"] == "notebook" and model["format"] == "json", {k: model.get(k) for k in ("type", "format")}
    assert model["path"] == CHAPTER and model["name"] == pathlib.Path(CHAPTER).name
    served = model["content"]
    on_disk = nbformat.read(ROOT / CHAPTER, as_version=4)
    assert served["nbformat"] == 4
    assert len(served["cells"]) == len(on_disk.cells)
    assert served["cells"][0]["source"] == on_disk.cells[0].source      # the chapter's title cell


@pytest.mark.timeout(60)
def test_jupyter_lab_refuses_a_request_without_the_token(lab):
    base, _ = lab
    status, _, _ = _get(f"{base}/api/contents/{CHAPTER}", token="not-the-token")
    assert status == 403, f"a wrong token got HTTP {status}"
