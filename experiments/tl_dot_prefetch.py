"""Probe: the tl.dot kernel's token-tile loop with the next tile's loads issued early, as the
Gluon kernel's producer does (:mod:`mla.kernels.gluon_sm90.ring` loads the next tile's indices
before it waits), beside the shipped loop.

The shipped loop waits on two dependent memory round trips a tile: the tile's indices, then the
cache bytes they address. Forms:

- ``shipped``: as :mod:`mla.kernels.tl_dot` has it;
- ``prefetch_idx``: the next tile's indices (and so its row offsets) are loaded right after this
  tile's cache loads are issued, so one round trip a tile overlaps this tile's decode and dots;
- ``prefetch_raw``: that, and the next tile's raw cache bytes are loaded before this tile is
  decoded (a register double buffer of the FP8 bytes: more registers, maybe spills).

``aot`` compiles each form ahead of time (Triton 3.6 on PYTHONPATH, no GPU) for sm_80, sm_90 and
sm_120 and reports registers, spills and the tile loops' instruction counts; ``gpu`` validates
each form against the reference and times it against the shipped one and FlashMLA.

    PYTHONPATH=/path/to/triton-3.6 python experiments/tl_dot_prefetch.py aot OUT.json
    python experiments/tl_dot_prefetch.py gpu OUT.json [--budget-s S]
    python experiments/tl_dot_prefetch.py apply FORM   # writes the form into mla/kernels/tl_dot.py
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHIPPED_LOOP = """    for ti in range(lo, hi):
        cache, valid, row, srow = _tile_rows(ti, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                             ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, V32)
        k0 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 0, 4, V32), [BLOCK_N, HALF])
        k1 = tl.reshape(load_token_tile(cache, row, srow, valid, FP8_NATIVE, DOT, 4, 4, V32), [BLOCK_N, HALF])
        if V32:
            kr = load_rope(cache, row, valid, DOT, V32)
        else:
            kr = None
        m_i, l_i, acc0, acc1 = _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, qr, kr, valid, sm_scale_log2,
                                            DOT, DV_HALVES, half, V32)
"""

# The prefetch forms are MODEL1's (V32 False: no rope tile, kr None), as the probe compiled them.
PREFETCH_IDX = """    cache, valid, row, srow = _tile_rows(lo, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                         ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, V32)
    for ti in range(lo, hi):
        nb0, sb0, r0 = load_raw(cache, row, srow, valid, 0, 4)
        nb1, sb1, r1 = load_raw(cache, row, srow, valid, 4, 4)
        v = valid
        cache, valid, row, srow = _tile_rows(ti + 1, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                             ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, V32)
        k0 = tl.reshape(dequant(nb0, sb0, r0, 0, 4, FP8_NATIVE, DOT), [BLOCK_N, HALF])
        k1 = tl.reshape(dequant(nb1, sb1, r1, 4, 4, FP8_NATIVE, DOT), [BLOCK_N, HALF])
        m_i, l_i, acc0, acc1 = _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, qr, None, v, sm_scale_log2,
                                            DOT, DV_HALVES, half, V32)
"""

PREFETCH_RAW = """    cache, valid, row, srow = _tile_rows(lo, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                         ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, V32)
    nb0, sb0, r0 = load_raw(cache, row, srow, valid, 0, 4)
    nb1, sb1, r1 = load_raw(cache, row, srow, valid, 4, 4)
    v = valid
    cache, valid, row, srow = _tile_rows(lo + 1, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                         ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, V32)
    for ti in range(lo, hi):
        k0 = tl.reshape(dequant(nb0, sb0, r0, 0, 4, FP8_NATIVE, DOT), [BLOCK_N, HALF])
        k1 = tl.reshape(dequant(nb1, sb1, r1, 4, 4, FP8_NATIVE, DOT), [BLOCK_N, HALF])
        vt = v
        nb0, sb0, r0 = load_raw(cache, row, srow, valid, 0, 4)
        nb1, sb1, r1 = load_raw(cache, row, srow, valid, 4, 4)
        v = valid
        cache, valid, row, srow = _tile_rows(ti + 2, tiles1, kc_ptr, kc_stride, kc_P, kc_n, idx_main, n1, ec_ptr,
                                             ec_stride, ec_P, ec_n, idx_extra, n2, BLOCK_N, HAS_EXTRA, V32)
        m_i, l_i, acc0, acc1 = _online_step(m_i, l_i, acc0, acc1, q0, q1, k0, k1, qr, None, vt, sm_scale_log2,
                                            DOT, DV_HALVES, half, V32)
"""

FORMS = {"shipped": SHIPPED_LOOP, "prefetch_idx": PREFETCH_IDX, "prefetch_raw": PREFETCH_RAW}


TL_DOT = ROOT / "mla" / "kernels" / "tl_dot.py"


def form_source(name: str) -> str:
    """mla/kernels/tl_dot.py's source with its token-tile loop replaced by form ``name``."""
    src = TL_DOT.read_text()
    assert src.count(SHIPPED_LOOP) == 1, "the shipped token-tile loop moved"
    if name != "shipped":
        src = src.replace(SHIPPED_LOOP, FORMS[name])
        src = src.replace("load_token_tile, piece", "load_token_tile, load_raw, dequant, piece")
    return src


def load_form(name: str):
    """The tl_dot module with its token-tile loop replaced by form ``name``, under a new name."""
    src = form_source(name).replace("from .. import", "from mla import").replace("from .", "from mla.kernels.")
    path = os.path.join(tempfile.mkdtemp(), f"tl_dot_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"tl_dot_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def provenance(note: str) -> dict:
    import triton

    return {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip(),
            "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"), "note": note}


def run_aot() -> dict:
    os.environ["TRITON_INTERPRET"] = "0"
    from mla import aot
    from mla.kernels import tl_dot

    shipped = tl_dot.tl_dot_decode_kernel
    kernels = {name: load_form(name).tl_dot_decode_kernel for name in FORMS}   # each form built once

    def compile_form(name, v):
        """Variant ``v`` of form ``name``'s kernel, compiled (aot looks the kernel up by name)."""
        tl_dot.tl_dot_decode_kernel = kernels[name]
        try:
            return aot._compile_in_process(v["kernel"], v["arch"], v["constexprs"], v["num_warps"],
                                           v["num_stages"], loops=True)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {str(e)[:600]}"}

    rows = []
    for arch in (80, 90, 120):
        for name in FORMS:
            for dv in (1, 2):
                r = compile_form(name, aot.tl_dot_variant(arch, dv_halves=dv, loops=True))
                rows.append({"arch": arch, "form": name, "dv_halves": dv, **r})
                print(arch, name, dv, json.dumps(r)[:400], file=sys.stderr)
    shipped_rows = []     # the configs mla launches per architecture (the no-spill test's), shipped and prefetch_idx
    for arch in (80, 89, 90, 100, 120):
        for cfg in aot.shipped_tl_dot_configs(arch):
            for name in ("shipped", "prefetch_idx"):
                r = compile_form(name, aot.config_variant(arch, cfg, loops=True))
                shipped_rows.append({"arch": arch, "form": name, "config": str(cfg), **r})
                print(arch, name, cfg, json.dumps(r.get("loops", r))[:300], file=sys.stderr)
    tl_dot.tl_dot_decode_kernel = shipped
    return {"about": "Dev probe (no GPU): the tl.dot kernel's token-tile loop with the next tile's indices (and "
                     "raw bytes) loaded early, compiled ahead of time at the generic config (block_h 64, block_n 64, "
                     "8 warps, one stage; dv_halves 1 and 2), sink, lengths and extra cache on (rows); and "
                     "prefetch_idx beside the shipped loop at every config mla launches on sm_80, 89, 90, 100 and "
                     "120 (shipped_config_rows: mla.aot.shipped_tl_dot_configs, the no-spill test's configs).",
            "rows": rows, "shipped_config_rows": shipped_rows, "provenance": provenance("compiled ahead of time without a GPU (Triton's bundled ptxas)")}


def gpu_shapes():
    from mla import bench

    grid = ((1, 1), (8, 1), (32, 2), (74, 1), (128, 1), (148, 2))
    return [bench.Shape(f"sweep {name}", b, s_q, h_q, **cfg) for h_q in (64, 128)
            for name, cfg in bench.SWEEP_CONFIGS.items() for b, s_q in grid
            if not (name == "long" and b > 74)]


def measure(case) -> dict:
    """One shape: each form's CUDA-graph time (the shipped loop first and last, for the run's drift)
    and whether its output is bitwise the shipped loop's."""
    import torch

    from mla import bench
    from mla.kernels import tl_dot

    s = case.shape
    row = {"shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "lengths": s.lengths, "mismatch": []}
    if bench.flash_mla is not None:
        row["us_flashmla"] = round(bench.time_graph(case, case.caller("flashmla")), 2)
    ref = None
    for name in ("shipped", "prefetch_idx", "prefetch_raw", "shipped"):
        tl_dot.tl_dot_decode_kernel = KERNELS[name]
        try:
            call = case.caller("tl_dot")
            out, lse = call(0)
            torch.cuda.synchronize()
            if ref is None:
                ref = (out.clone(), lse.clone())
                row["launch"] = call.plan.launch.config.label
            elif not (torch.equal(out, ref[0]) and torch.equal(lse, ref[1])):
                row["mismatch"].append([name, (out.float() - ref[0].float()).abs().max().item()])
            row.setdefault(name, []).append(round(bench.time_graph(case, call), 2))
        finally:
            tl_dot.tl_dot_decode_kernel = KERNELS["shipped"]
    return row


KERNELS: dict = {}


def run_gpu(argv) -> None:
    from experiments import probe_main
    from mla.kernels import tl_dot

    KERNELS["shipped"] = tl_dot.tl_dot_decode_kernel
    for name in ("prefetch_idx", "prefetch_raw"):
        KERNELS[name] = load_form(name).tl_dot_decode_kernel
    probe_main(argv, __doc__, "tl_dot_prefetch", gpu_shapes, measure, budget_s=240)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gpu"]:
        return run_gpu(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("aot", "gpu", "apply"))
    ap.add_argument("out", nargs="?", help="aot: where to write the record (JSON), printed either way; "
                                           "apply: the form to write into mla/kernels/tl_dot.py")
    a = ap.parse_args(argv)
    if a.mode == "apply":
        if a.out not in FORMS:
            ap.error(f"apply: FORM is one of {', '.join(FORMS)}")
        TL_DOT.write_text(form_source(a.out))
        return
    record = run_aot()
    text = json.dumps(record, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text[:3000])


if __name__ == "__main__":
    main()
