"""Dev tools and probes (not packaged): rejected variants, ablations and measurements."""
import argparse
import json
import pathlib
import sys
import time

from mla import bench   # mla first, as every probe imports it: it may turn Triton's interpreter on
import torch  # noqa: E402

import mla  # noqa: E402


def write_rows(path, rows: list, device, **extra) -> None:
    """A probe's ``rows`` as JSON at ``path``, under the run's provenance (:func:`mla.bench.provenance`,
    with the ceilings measured now on ``device``) and any ``extra`` fields."""
    doc = {"provenance": bench.provenance(bench.ceilings(device)), "rows": rows, **extra}
    pathlib.Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def probe_points(shapes, measure, out, budget_s: float) -> list:
    """A probe's loop on the GPU: ``measure(case)`` (a row) at each of ``shapes`` in turn, their
    caches shared per page size, none started after ``budget_s`` seconds; each row printed as it
    comes and all written to ``out`` (:func:`write_rows`) with the seconds taken."""
    t0 = time.time()
    dev = torch.device("cuda")
    pools, rows = {}, []
    for s in shapes:
        if time.time() - t0 > budget_s:
            break
        case = bench.Case(s, dev, pool_bytes=1e9, n_sets=8, pools=pools)
        rows.append(measure(case))
        print(rows[-1], flush=True)
        del case
    write_rows(out, rows, dev, seconds=round(time.time() - t0, 1))
    return rows


def probe_main(argv, doc: str, name: str, shapes, measure, budget_s: float) -> None:
    """A probe script's command line, ``OUT.json [--budget-s S]`` (``doc`` its help), then its
    loop (:func:`probe_points`) over ``shapes()``; without a GPU it exits saying so."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=budget_s)
    a = ap.parse_args(argv)
    if mla.INTERPRET:
        sys.exit(f"{name}: needs a CUDA GPU")
    probe_points(shapes(), measure, a.out, a.budget_s)
