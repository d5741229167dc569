"""Dev probe (no GPU: compiled ahead of time for sm_90a): which Gluon exchange lets the two CTAs of a
cluster each decode half of a [64 tokens, 512] fp16 token tile and both then hold it whole in
shared memory, ready for ``warpgroup_mma``, at about one cluster synchronization a tile?

experiments/cluster_convert.py found that ``gl.convert_layout`` between CGA layouts compiles under
3.9 but moves the tile through distributed shared memory 32 times, with 32 cluster barrier pairs.
This compiles, for 2 CTAs a cluster (``num_ctas=2``), the candidates Triton 3.9's Gluon offers
and records for each whether it compiles (or the compiler's error) and the PTX's cluster operations
a tile: ``st.async`` (``hopper.async_store``), ``st``/``ld.shared::cluster``, ``mapa`` (with the CTA
each targets: the own rank register or a constant), cluster barriers, mbarrier operations (local
and cluster-scoped) and multicast bulk copies. Kernels that loop over tiles are counted inside the
loop body, the others whole. Candidates:

  convert_layout         the cluster_convert.py kernel, counted the same way, as the baseline
  st_async_whole_dst     ``hopper.async_store`` of the half tile into a [64, 512] buffer every CTA
                         holds whole (CGA ``[[0, 0]]``): does st.async write the peer's copy?
  st_async_copies_wgmma  the tile stored as [2 copies, 64, 512] with the copy dimension over the CTAs
                         (CGA ``[[1, 0, 0]]``) from a register tensor broadcast over it: every CTA's
                         st.async writes its half into both CTAs, an mbarrier in each receives 64 KiB,
                         the buffer is reinterpreted as the whole [64, 512] tile (CGA ``[[0, 0]]``) and
                         read by ``warpgroup_mma`` (Q [128 heads, 512] split 64 a CTA, S = Q K^T);
                         one cluster barrier a tile guards the buffer's reuse
  local_store_copies     the same, with ``smem.store`` (st.shared::cluster) in place of st.async and a
                         second cluster barrier a tile for the stores to land
  local_store_copies_2buf  that with two buffers, two tiles a loop iteration, so that one cluster
                         barrier a tile both publishes the tile and frees the buffer of the tile before
  tma_multicast_raw      for reference, not an exchange of decoded data: one ``tma.async_load`` with
                         ``multicast=True`` of the FP8 tile into a buffer both CTAs hold whole

Each run replaces the rows of the Triton it runs with in OUT.json.

    python experiments/cluster_exchange.py OUT.json
"""
import argparse
import collections
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
from triton.experimental.gluon.language.nvidia import hopper  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import cluster, mbarrier, tma  # noqa: E402

TOKENS, DIM, HEADS = 64, 512, 128      # HEADS: both CTAs together, 64 each


@gluon.jit
def convert_layout(x_ptr, y_ptr, SPLIT: gl.constexpr, WHOLE: gl.constexpr, TOKENS: gl.constexpr,
                   DIM: gl.constexpr):
    """cluster_convert.py's kernel: each CTA loads its half of the rows, then both hold it whole."""
    rows = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, WHOLE))
    cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, WHOLE))
    offs = rows[:, None] * DIM + cols[None, :]
    half = gl.load(x_ptr + gl.convert_layout(offs, SPLIT)) * 2.0
    whole = gl.convert_layout(half, WHOLE)
    gl.store(y_ptr + gl.program_id(0) * TOKENS * DIM + offs, whole)


@gluon.jit
def st_async_whole_dst(x_ptr, y_ptr, SPLIT: gl.constexpr, SMEM: gl.constexpr, WHOLE: gl.constexpr,
                       TOKENS: gl.constexpr, DIM: gl.constexpr):
    """st.async of the half (CGA rows) into a buffer whose CGA layout says every CTA holds it whole."""
    rows = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, SPLIT))
    cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, SPLIT))
    half = gl.load(x_ptr + rows[:, None] * DIM + cols[None, :]) * 2.0
    tile = gl.allocate_shared_memory(gl.float16, [TOKENS, DIM], SMEM)
    bar = mbarrier.allocate_mbarrier()
    mbarrier.init(bar, count=1)
    cluster.barrier()
    mbarrier.expect(bar, tile.nbytes_per_cta)
    hopper.async_store(tile, half, bar)
    mbarrier.wait(bar, 0, deps=[tile])
    whole = tile.load(WHOLE)
    r = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, WHOLE))
    c = gl.arange(0, DIM, layout=gl.SliceLayout(0, WHOLE))
    gl.store(y_ptr + gl.program_id(0) * TOKENS * DIM + r[:, None] * DIM + c[None, :], whole)


@gluon.jit
def _halves_and_q(q_ptr, L3: gl.constexpr, QSMEM: gl.constexpr, QL: gl.constexpr, TOKENS: gl.constexpr,
                  DIM: gl.constexpr, HEADS: gl.constexpr):
    """The offsets of this CTA's half of a [TOKENS, DIM] tile (CGA: the row halves) and Q in shared memory."""
    SPLIT: gl.constexpr = gl.SliceLayout(0, L3)
    rows = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, SPLIT))
    cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, SPLIT))
    qr = gl.arange(0, HEADS, layout=gl.SliceLayout(1, QL))
    qc = gl.arange(0, DIM, layout=gl.SliceLayout(0, QL))
    q_smem = gl.allocate_shared_memory(gl.float16, [HEADS, DIM], QSMEM, gl.load(q_ptr + qr[:, None] * DIM + qc[None, :]))
    return rows[:, None] * DIM + cols[None, :], q_smem


@gluon.jit
def copies_wgmma(kv_ptr, q_ptr, o_ptr, n_tiles, L3: gl.constexpr, SMEM3: gl.constexpr, SMEM2: gl.constexpr,
                 QSMEM: gl.constexpr, QL: gl.constexpr, ACC: gl.constexpr, TOKENS: gl.constexpr,
                 DIM: gl.constexpr, HEADS: gl.constexpr, ASYNC: gl.constexpr):
    """Each CTA decodes its 32 rows of every FP8 tile and stores them into both CTAs' copy; S = Q K^T."""
    offs, q_smem = _halves_and_q(q_ptr, L3, QSMEM, QL, TOKENS, DIM, HEADS)
    copies = gl.allocate_shared_memory(gl.float16, [2, TOKENS, DIM], SMEM3)   # copy c lives in CTA c
    whole = copies.reinterpret(shape=[TOKENS, DIM], layout=SMEM2)              # each CTA: its copy, whole
    full = mbarrier.allocate_mbarrier()                                        # one a CTA
    mbarrier.init(full, count=1)
    cluster.barrier()
    acc = gl.zeros([HEADS, TOKENS], gl.float32, ACC)
    for t in range(n_tiles):
        half = (gl.load(kv_ptr + t * TOKENS * DIM + offs).to(gl.float32) * 0.5).to(gl.float16)   # the decode
        both = gl.broadcast(gl.expand_dims(half, 0), gl.full([2, TOKENS, DIM], 0.0, gl.float16, L3))[0]
        cluster.barrier()                 # both CTAs have read the previous tile: its buffer may be rewritten
        if ASYNC:
            mbarrier.expect(full, copies.nbytes_per_cta)
            hopper.async_store(copies, both, full)
            mbarrier.wait(full, t & 1, deps=[copies])
        else:
            copies.store(both)
            cluster.barrier()
        acc = hopper.warpgroup_mma(q_smem, whole.permute([1, 0]), acc)
    orow = gl.arange(0, HEADS, layout=gl.SliceLayout(1, ACC))
    ocol = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, ACC))
    gl.store(o_ptr + gl.program_id(0) * HEADS * TOKENS + orow[:, None] * TOKENS + ocol[None, :], acc)


@gluon.jit
def _store_then_mma(kv_ptr, offs, t, copies, whole, q_smem, acc, L3: gl.constexpr, TOKENS: gl.constexpr,
                    DIM: gl.constexpr):
    half = (gl.load(kv_ptr + t * TOKENS * DIM + offs).to(gl.float32) * 0.5).to(gl.float16)
    both = gl.broadcast(gl.expand_dims(half, 0), gl.full([2, TOKENS, DIM], 0.0, gl.float16, L3))[0]
    copies.store(both)
    cluster.barrier()                 # this tile is in both CTAs; and both have read the tile before the last
    return hopper.warpgroup_mma(q_smem, whole.permute([1, 0]), acc)


@gluon.jit
def copies_wgmma_2buf(kv_ptr, q_ptr, o_ptr, n_tiles, L3: gl.constexpr, SMEM3: gl.constexpr, SMEM2: gl.constexpr,
                      QSMEM: gl.constexpr, QL: gl.constexpr, ACC: gl.constexpr, TOKENS: gl.constexpr,
                      DIM: gl.constexpr, HEADS: gl.constexpr):
    """local_store_copies with two buffers, two tiles a loop iteration: one cluster barrier a tile."""
    offs, q_smem = _halves_and_q(q_ptr, L3, QSMEM, QL, TOKENS, DIM, HEADS)
    copies0 = gl.allocate_shared_memory(gl.float16, [2, TOKENS, DIM], SMEM3)
    copies1 = gl.allocate_shared_memory(gl.float16, [2, TOKENS, DIM], SMEM3)
    whole0 = copies0.reinterpret(shape=[TOKENS, DIM], layout=SMEM2)
    whole1 = copies1.reinterpret(shape=[TOKENS, DIM], layout=SMEM2)
    acc = gl.zeros([HEADS, TOKENS], gl.float32, ACC)
    for t in range(0, n_tiles, 2):
        acc = _store_then_mma(kv_ptr, offs, t, copies0, whole0, q_smem, acc, L3, TOKENS, DIM)
        acc = _store_then_mma(kv_ptr, offs, t + 1, copies1, whole1, q_smem, acc, L3, TOKENS, DIM)
    orow = gl.arange(0, HEADS, layout=gl.SliceLayout(1, ACC))
    ocol = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, ACC))
    gl.store(o_ptr + gl.program_id(0) * HEADS * TOKENS + orow[:, None] * TOKENS + ocol[None, :], acc)


@gluon.jit
def tma_multicast_raw(kv_ptr, o_ptr, n, SMEM: gl.constexpr, WHOLE: gl.constexpr, TOKENS: gl.constexpr,
                      DIM: gl.constexpr):
    """The FP8 tile by TMA, multicast: both CTAs receive it whole (each still decodes all of it)."""
    desc = tma.make_tensor_descriptor(kv_ptr, [n, DIM], [DIM, 1], [TOKENS, DIM], SMEM)
    tile = gl.allocate_shared_memory(gl.float8e4nv, [TOKENS, DIM], SMEM)
    bar = mbarrier.allocate_mbarrier()
    mbarrier.init(bar, count=1)
    cluster.barrier()
    mbarrier.expect(bar, TOKENS * DIM)
    tma.async_load(desc, [gl.program_id(0) * TOKENS, 0], bar, tile, multicast=True)
    mbarrier.wait(bar, 0, deps=[tile])
    x = tile.load(WHOLE).to(gl.float16)
    r = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, WHOLE))
    c = gl.arange(0, DIM, layout=gl.SliceLayout(0, WHOLE))
    gl.store(o_ptr + gl.program_id(0) * TOKENS * DIM + r[:, None] * DIM + c[None, :], x)


def candidates():
    """(name, kernel, signature, constexprs, what it stands for)."""
    split = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=[[1, 0]])   # CTA bit: the row halves
    whole = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=[[0, 0]])   # both CTAs: every row
    nvmma = lambda rank, bits, cga: gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits,  # noqa: E731
                                                         rank=rank, cga_layout=cga)
    copies3 = dict(   # register tensor [copy, row, col]: both copies in every thread's registers, rows over CTAs
        L3=gl.BlockedLayout([2, 1, 8], [1, 4, 8], [1, 4, 1], [2, 1, 0], cga_layout=[[0, 1, 0]]),
        SMEM3=nvmma(3, 16, [[1, 0, 0]]), SMEM2=nvmma(2, 16, [[0, 0]]), QSMEM=nvmma(2, 16, [[1, 0]]),
        QL=gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=[[1, 0]]),
        ACC=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16],
                                      cga_layout=[[1, 0]]),
        TOKENS=TOKENS, DIM=DIM, HEADS=HEADS)
    copies_sig = {"kv_ptr": "*fp8e4nv", "q_ptr": "*fp16", "o_ptr": "*fp32", "n_tiles": "i32"}
    return [
        ("convert_layout", convert_layout, {"x_ptr": "*fp16", "y_ptr": "*fp16"},
         dict(SPLIT=split, WHOLE=whole, TOKENS=TOKENS, DIM=DIM),
         "gl.convert_layout(half, layout whose CGA bases are [[0, 0]])"),
        ("st_async_whole_dst", st_async_whole_dst, {"x_ptr": "*fp16", "y_ptr": "*fp16"},
         dict(SPLIT=split, SMEM=nvmma(2, 16, [[0, 0]]), WHOLE=whole, TOKENS=TOKENS, DIM=DIM),
         "hopper.async_store(smem [64, 512] CGA [[0, 0]], half CGA [[1, 0]], mbarrier)"),
        ("st_async_copies_wgmma", copies_wgmma, copies_sig, {**copies3, "ASYNC": True},
         "hopper.async_store(smem [2, 64, 512] CGA [[1, 0, 0]], half broadcast to [2, 64, 512], mbarrier); "
         "smem.reinterpret([64, 512], CGA [[0, 0]]) -> warpgroup_mma; cluster.barrier() a tile"),
        ("local_store_copies", copies_wgmma, copies_sig, {**copies3, "ASYNC": False},
         "smem [2, 64, 512] CGA [[1, 0, 0]].store(half broadcast to [2, 64, 512])"),
        ("local_store_copies_2buf", copies_wgmma_2buf, copies_sig, copies3,
         "local_store_copies with two buffers (two tiles a loop iteration; counts halved to one tile)"),
        ("tma_multicast_raw", tma_multicast_raw, {"kv_ptr": "*fp8e4nv", "o_ptr": "*fp16", "n": "i32"},
         dict(SMEM=nvmma(2, 8, [[0, 0]]), WHOLE=gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0], cga_layout=[[0, 0]]),
              TOKENS=TOKENS, DIM=DIM),
         "tma.async_load(desc, coord, mbarrier, smem CGA [[0, 0]], multicast=True) of the FP8 tile"),
    ]


def loop_body(ptx: str) -> str | None:
    """The PTX between the (single) loop header and its back edge, None if the kernel has no loop."""
    m = re.search(r"^(\$L__BB\d+_\d+):[^\n]*Loop Header", ptx, re.M)
    if not m:
        return None
    back = [b.start() for b in re.finditer(rf"bra(?:\.uni)?\s+{re.escape(m.group(1))};", ptx)]
    return ptx[m.end():back[-1]] if back else None


def count(ptx: str) -> dict:
    ops = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    mapa = collections.Counter("own rank (register)" if t.startswith("%") else f"CTA {t}"
                               for t in re.findall(r"\bmapa\.shared::cluster\.u32\s+[^,]+,\s*[^,]+,\s*([^;\s]+);", ptx))
    return {
        "st.async": ops(r"\bst\.async\b"), "st.shared::cluster": ops(r"\bst\.shared::cluster"),
        "ld.shared::cluster": ops(r"\bld\.shared::cluster"), "mapa": ops(r"\bmapa\."), "mapa_targets": dict(mapa),
        "barrier.cluster.arrive": ops(r"\bbarrier\.cluster\.arrive"),
        "barrier.cluster.wait": ops(r"\bbarrier\.cluster\.wait"),
        "mbarrier (cta scope)": ops(r"\bmbarrier\.[\w.]*shared::cta"),
        "mbarrier (cluster scope)": ops(r"\bmbarrier\.[\w.]*shared::cluster|\bfence\.mbarrier_init\.release\.cluster"),
        "mbarrier expect_tx bytes": [int(b) for b in re.findall(r"expect_tx\.shared::cta\.b64\s+_,\s*\[[^]]+\],\s*(\d+)", ptx)],
        "cp.async.bulk multicast": ops(r"\bcp\.async\.bulk\.[\w.:]*multicast::cluster"),
        "fence.proxy.async": ops(r"\bfence\.proxy\.async"),
        "wgmma.mma_async": ops(r"\bwgmma\.mma_async"),
        "st.shared (local)": ops(r"\bst\.shared\.(?!:)"), "ld.shared (local)": ops(r"\bld\.shared\.(?!:)"),
    }


def compile_row(name, fn, sig, consts, what) -> dict:
    """Compile one candidate for sm_90a with 2 CTAs a cluster; the outcome as a row."""
    src = GluonASTSource(fn, {**sig, **{k: "constexpr" for k in consts}}, consts)
    row = {"candidate": name, "api": what, "triton": triton.__version__, "arch": "sm_90a", "num_ctas": 2,
           "num_warps": 4, "tile": [TOKENS, DIM], "dtype": "fp16"}
    with tempfile.TemporaryFile(mode="w+") as err:      # MLIR writes its diagnostics to fd 2
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": 2})
        except Exception as e:       # the compiler's own diagnostic is the finding
            os.dup2(saved, 2)
            err.seek(0)
            text = err.read() + "\n" + str(e)
            diag = re.findall(r"error\s*: ([^\n]+)", text) or [f"{type(e).__name__}: {e}".splitlines()[0]]
            return {**row, "compiles": False, "error": diag[0][:400]}
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    ptx = kernel.asm["ptx"]
    body = loop_body(ptx)
    ops = count(body if body is not None else ptx)
    per_iter = 2 if name.endswith("_2buf") else 1        # tiles a loop iteration
    if per_iter > 1:
        ops = {k: ((v // per_iter if v % per_iter == 0 else v / per_iter) if isinstance(v, int) else v)
               for k, v in ops.items()}
    return {**row, "compiles": True, "shared_bytes": kernel.metadata.shared,
            "counted": ("loop body / %d (one tile)" % per_iter) if body is not None else "whole kernel (one tile)",
            "ops": ops, "ops_whole_kernel": count(ptx)}


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
                         "note": "compiled ahead of time on a machine without a GPU (Triton's bundled ptxas); "
                                 "nothing here ran"}
    rows = [compile_row(*c) for c in candidates()]
    doc["rows"] = [r for r in doc["rows"] if r["triton"] != triton.__version__] + rows
    path.write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        print(json.dumps({k: r[k] for k in ("candidate", "compiles") if k in r} | {"ops": r.get("ops"), "error": r.get("error")}))


if __name__ == "__main__":
    sys.exit(main())
