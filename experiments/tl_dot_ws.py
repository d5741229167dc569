"""Probe: the tl.dot kernel's token-tile loop as ``tl.range(..., warp_specialize=True)`` (and a
software-pipelined ``num_stages`` form), compiled ahead of time for sm_90 beside the shipped loop.

Run with the Triton the GPU image has (3.6) on PYTHONPATH; it writes (to the path given) and
prints one record: per variant the registers, spill bytes and the tensor-core loops' instruction
counts. A variant's source is the shipped module with the loop line rewritten, loaded under a
new name.

    PYTHONPATH=/path/to/triton-3.6 python experiments/tl_dot_ws.py OUT.json
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"     # compiled, not interpreted: set before Triton is imported

import triton  # noqa: E402

from mla import aot  # noqa: E402
from mla.kernels import tl_dot  # noqa: E402

LOOP = "    for ti in range(lo, hi):\n"
FORMS = {
    "shipped": LOOP,
    "warp_specialize": "    for ti in tl.range(lo, hi, warp_specialize=True):\n",
    "stages2": "    for ti in tl.range(lo, hi, num_stages=2):\n",
}


def load_form(name: str, line: str):
    src = open(tl_dot.__file__).read()
    assert src.count(LOOP) == 1, "the shipped token-tile loop moved"
    src = src.replace(LOOP, line).replace("from .. import", "from mla import").replace("from .", "from mla.kernels.")
    d = tempfile.mkdtemp()
    path = os.path.join(d, f"tl_dot_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"tl_dot_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="where to write the record (JSON); printed either way")
    a = ap.parse_args(argv)
    out = []
    for name, line in FORMS.items():
        mod = load_form(name, line)
        tl_dot.tl_dot_decode_kernel = mod.tl_dot_decode_kernel   # aot._kernel looks it up by name
        v = aot.tl_dot_variant(90, loops=True)
        try:
            r = aot._compile_in_process(v["kernel"], 90, v["constexprs"], v["num_warps"], v["num_stages"],
                                        want_asm=("ptx",), loops=True)
            r["ptx_sha1"] = hashlib.sha1(r.pop("ptx").encode()).hexdigest()[:12]
        except Exception as e:  # noqa: BLE001
            r = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
        out.append({"form": name, **r})
        print(name, json.dumps(r)[:600], file=sys.stderr)
    record = {"about": "Dev probe (no GPU: compiled ahead of time for sm_90a): does the tl.dot kernel's token-tile "
                       "loop change under tl.range(warp_specialize=True) or num_stages=2? The H200 table's "
                       "config (block_h 64, block_n 64, 8 warps), sink, lengths and extra cache on.",
              "rows": out,
              "provenance": {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                      text=True).stdout.strip(),
                             "triton": triton.__version__,
                             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
                             "note": "compiled ahead of time on a machine without a GPU (Triton's bundled ptxas)"}}
    text = json.dumps(record, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
