"""Dev probe (GPU): the b = 1 shapes (DSA, V4-CSA, V4-TP8) with the portable tl.dot kernel, at
the split count the launch rule picks (:func:`mla.dispatch.programs_for`: programs over the work list) and at a half, a quarter
of it and 4, to see whether the picked count is the fastest. Two configs: the shipped one
(:func:`mla.configs.lookup`) as the small-grid rule fills it (:func:`mla.dispatch.fill_small_grid`),
and the same with 32-token tiles, its grid always treated as small. CUDA-graph us per call,
written to $OUT/b1_probe.json.

    OUT=out python experiments/b1_probe.py
"""
import argparse
import dataclasses
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402

from mla import bench, configs, dispatch  # noqa: E402
from mla.bench import Case, Shape  # noqa: E402


def planned(case, config, splits):
    """``call(i)`` for :func:`mla.bench.time_graph`: the decode with ``config`` and ``splits``
    forced, through one plan made here (as a serving step would)."""
    plan = mla.plan(case.q, case.cache, case.index_sets[0], **case.kwargs(0), config=config, programs=splits)
    return lambda i: mla.sparse_decode(case.q, case.cache, case.index_sets[i], **case.kwargs(i), plan=plan)


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if mla.INTERPRET:
        sys.exit("b1_probe: needs a CUDA GPU; here mla runs Triton's CPU interpreter")
    dev = torch.device("cuda")
    sms = dispatch.sm_count(dev)
    out = {"rows": []}
    for s in (Shape("DSA", 1, 1, 64, 2048, 64), Shape("V4-CSA", 1, 1, 64, 128, 256, 512, 64),
              Shape("V4-TP8", 1, 1, 8, 128, 256, 512, 64)):
        case = Case(s, dev, pool_bytes=5e8, n_sets=16)
        base = configs.lookup(s.h_q, dev)
        cfgs = {"shipped": dispatch.fill_small_grid(base, s.b, s.s_q, s.h_q, s.topk_total, sms),
                "bn32": dispatch.fill_small_grid(dataclasses.replace(base, block_n=32), s.b, s.s_q, s.h_q,
                                                 s.topk_total, 1 << 20)}
        for name, cfg in cfgs.items():
            auto = dispatch.programs_for(cfg.for_heads(s.h_q), s.b * s.s_q, s.h_q, s.topk, s.extra_topk, sms,
                                         False)[0]
            for sp in sorted({auto, max(1, auto // 2), max(1, auto // 4), 4}):
                us = bench.time_graph(case, planned(case, cfg, sp))
                out["rows"].append({"shape": s.name, "b": 1, "config": name, "splits": sp, "auto_splits": auto,
                                    "us_graph": round(us, 2), "cfg": dataclasses.asdict(cfg)})
                print(s.name, name, "splits", sp, "(auto", auto, ")", f"{us:.2f} us", flush=True)
        del case
        torch.cuda.empty_cache()
    out["provenance"] = bench.provenance(bench.ceilings(dev))
    o = pathlib.Path(os.environ.get("OUT", "out"))
    o.mkdir(parents=True, exist_ok=True)
    (o / "b1_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
