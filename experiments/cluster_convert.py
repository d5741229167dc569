"""Dev probe (no GPU: compiled ahead of time for sm_90a): can Gluon share one decoded token tile
between the two CTAs of a cluster, as FlashMLA's 128-head kernel does?

FlashMLA runs 128 heads as a 2-CTA cluster: each CTA decodes half of every token tile and
stores it into both CTAs' shared memory (``st.async`` to the peer), so the tile is decoded once
for all 128 heads. One CTA cannot hold the 128 x 512 fp32 accumulators (the whole register
file), so ``mla`` runs two 64-head programs that each decode the whole tile. The only cross-CTA
move Gluon offers is ``gl.convert_layout`` between layouts whose CGA bases differ (``num_ctas``
2): here a [64 tokens, 512] fp16 tile split by rows over the two CTAs, converted to the layout
both CTAs hold whole. This compiles that conversion under the Triton it runs with and records
whether it compiles and, if it does, the PTX's cluster operations: distributed shared memory
accesses (``shared::cluster``), ``mapa`` and cluster barriers. Each run adds one row to OUT.json.

    python experiments/cluster_convert.py OUT.json
    PYTHONPATH=/path/to/triton-3.6 python experiments/cluster_convert.py OUT.json
"""
import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"     # compiled, not interpreted: set before Triton is imported

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

TOKENS, DIM = 64, 512


@gluon.jit
def split_to_whole(x_ptr, y_ptr, SPLIT: gl.constexpr, WHOLE: gl.constexpr, TOKENS: gl.constexpr,
                   DIM: gl.constexpr):
    """Each CTA loads (stands for: decodes) its half of the tile's rows, then both hold it whole."""
    rows = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, WHOLE))
    cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, WHOLE))
    offs = rows[:, None] * DIM + cols[None, :]
    half = gl.load(x_ptr + gl.convert_layout(offs, SPLIT)) * 2.0
    whole = gl.convert_layout(half, WHOLE)
    gl.store(y_ptr + gl.program_id(0) * TOKENS * DIM + offs, whole)


def compile_row() -> dict:
    """Compile the conversion for sm_90a with 2 CTAs a cluster; the outcome as a row."""
    split = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=[[1, 0]])   # CTA bit: the row halves
    whole = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=[[0, 0]])   # both CTAs: every row
    src = GluonASTSource(split_to_whole, {"x_ptr": "*fp16", "y_ptr": "*fp16", "SPLIT": "constexpr",
                                          "WHOLE": "constexpr", "TOKENS": "constexpr", "DIM": "constexpr"},
                         {"SPLIT": split, "WHOLE": whole, "TOKENS": TOKENS, "DIM": DIM})
    row = {"triton": triton.__version__, "arch": "sm_90a", "num_ctas": 2, "tile": [TOKENS, DIM], "dtype": "fp16"}
    with tempfile.TemporaryFile(mode="w+") as err:      # MLIR writes its diagnostics to fd 2
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 4, "num_ctas": 2}).asm["ptx"]
        except Exception as e:       # the compiler's own diagnostic is the finding
            os.dup2(saved, 2)
            err.seek(0)
            diag = re.findall(r"error: ([^\n]+)", err.read()) or [f"{type(e).__name__}: {e}".splitlines()[0]]
            return {**row, "compiles": False, "error": diag[0][:400]}
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    ops = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    return {**row, "compiles": True, "ops": {
        "ld.shared::cluster": ops(r"\bld\.shared::cluster"), "st.shared::cluster": ops(r"\bst\.shared::cluster"),
        "st.async": ops(r"\bst\.async"), "mapa": ops(r"\bmapa\."),
        "barrier.cluster.arrive": ops(r"\bbarrier\.cluster\.arrive"),
        "barrier.cluster.wait": ops(r"\bbarrier\.cluster\.wait"),
        "ld.shared (local)": ops(r"\bld\.shared\.(?!:)"), "st.shared (local)": ops(r"\bst\.shared\.(?!:)")}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    a = ap.parse_args(argv)
    path = pathlib.Path(a.out)
    about = " ".join(__doc__.split("\n\n")[0].split())
    doc = json.loads(path.read_text()) if path.exists() else {"about": about, "rows": []}
    commit = subprocess.run(["git", "-C", str(pathlib.Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    doc["provenance"] = {"commit": commit, "date": now,
                         "note": "compiled ahead of time on a machine without a GPU (Triton's bundled ptxas)"}
    row = compile_row()
    doc["rows"] = [r for r in doc["rows"] if r["triton"] != row["triton"]] + [row]
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    sys.exit(main())
