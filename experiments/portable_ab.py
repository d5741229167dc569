"""Dev tool (GPU): the portable Gluon kernel before and after v42 in the same run, CUDA-graph us
per call at a few record and sweep shapes, its sm_90, sm_80 and sm_89 code (mla.kernels.cross_arch),
beside tl_dot, mma and FlashMLA.

v42 changed three things: the warps' grid at 64 x 64 tiles (2 x 4, not 4 x 2: less shared memory
read per tile), the next tile's indices loaded a tile early, and sm_80's FP8 decode in fp16
(``prmt``); with them sm_80 gets a 64-head form (64 x 32 tokens, 3 stages) instead of 32 heads.
``--kernel-file`` swaps in another kernel source (the one before, from git: ``git show
a4188f0:mla/kernels/gluon_portable.py``) and ``--old-forms`` the forms it shipped with.

    python experiments/portable_ab.py OUT.json --label new [--kernel-file F] [--old-forms] [--impl I ...]
"""
import argparse
import importlib.util
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402

from experiments import write_rows  # noqa: E402
from mla import bench, dispatch  # noqa: E402
from mla.configs import PortableConfig  # noqa: E402
from mla.kernels import cross_arch  # noqa: E402

#: the forms before v42, per architecture, at 64 heads and more (32 heads off Hopper's 227 KB)
OLD_FORMS = {90: PortableConfig(64, 64, 2), 80: PortableConfig(32, 32, 3), 89: PortableConfig(16, 32, 2)}
IMPLS = ("gluon_portable", "gluon_portable_sm80", "gluon_portable_sm89")


def shapes():
    by_key = {(s.name, s.b): s for s in bench.spec_shapes()}
    sweep = [bench.Shape(f"sweep {n}", b, s_q, h, **bench.SWEEP_CONFIGS[n])
             for n, b, s_q, h in (("DSA", 64, 1, 128), ("HCA", 32, 1, 64), ("CSA", 2, 2, 64))]
    return [by_key[k] for k in (("DSA", 128), ("V4-CSA", 128), ("DSA", 8))] + sweep


def swap_kernel(path: str) -> None:
    """Run the portable kernel from ``path`` (a copy of mla/kernels/gluon_portable.py)."""
    spec = importlib.util.spec_from_file_location("mla.kernels.gluon_portable", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mla.kernels.gluon_portable"] = mod
    spec.loader.exec_module(mod)
    dispatch.gluon_portable = cross_arch.gluon_portable = mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--label", required=True)
    ap.add_argument("--kernel-file")
    ap.add_argument("--old-forms", action="store_true")
    ap.add_argument("--impl", action="append", help=f"default {IMPLS}")
    ap.add_argument("--budget-s", type=float, default=150)
    a = ap.parse_args(argv)
    if mla.INTERPRET:
        sys.exit("portable_ab: needs a CUDA GPU")
    if a.kernel_file:
        swap_kernel(a.kernel_file)
    if a.old_forms:
        dispatch.gluon_portable_config = lambda arch, h_q: OLD_FORMS[arch].for_heads(h_q)
    t0, dev, pools, rows = time.time(), torch.device("cuda"), {}, []
    for s in shapes():
        case = bench.Case(s, dev, pool_bytes=1e9, n_sets=8, pools=pools)
        for impl in a.impl or IMPLS:
            if time.time() - t0 > a.budget_s:
                break
            if impl == "flashmla" and bench.flash_mla is None:
                continue
            call = case.caller(impl)
            launch = getattr(getattr(call, "plan", None), "launch", None)
            rows.append({"label": a.label, "shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "impl": impl,
                         "launch": str(launch)[:200], "us_graph": round(bench.time_graph(case, call), 2)})
            print(rows[-1], flush=True)
        del case
    write_rows(a.out, rows, dev, label=a.label, seconds=round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
