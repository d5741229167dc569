"""Dev probe (GPU): b = 1 shapes under several split counts and tile sizes (CUDA-graph us)."""
import dataclasses
import json
import os
import pathlib

import torch

from mla import bench
from mla.bench import Case, Shape
from mla.kernels.mma import MMAConfig, default_config, fill_small_grid, mma_sparse_decode, num_splits, sm_count

dev = torch.device("cuda")
out = {"rows": []}
for s in (Shape("DSA", 1, 1, 64, 2048, 64), Shape("V4-CSA", 1, 1, 64, 128, 256, 512, 64),
          Shape("V4-TP8", 1, 1, 8, 128, 256, 512, 64)):
    case = Case(s, dev, pool_bytes=5e8, n_sets=16)
    base = default_config(s.h_q, dev)
    cfgs = {"shipped": fill_small_grid(base, s.b, s.s_q, s.h_q, s.topk_total, sm_count(dev))}
    cfgs["bn32"] = fill_small_grid(dataclasses.replace(base, block_n=32), s.b, s.s_q, s.h_q, s.topk_total, 1 << 20)
    for name, cfg in cfgs.items():
        auto = num_splits(s.b, s.s_q, s.h_q, s.topk_total, cfg.for_heads(s.h_q), sm_count(dev))
        for sp in sorted({auto, max(1, auto // 2), max(1, auto // 4), 4}):
            us = bench.time_graph(case, lambda *a, _c=cfg, _s=sp, **k: mma_sparse_decode(*a, **k, config=_c, splits=_s))
            row = {"shape": s.name, "b": 1, "config": name, "splits": sp, "auto_splits": auto, "us_graph": round(us, 2),
                   "cfg": dataclasses.asdict(cfg)}
            out["rows"].append(row)
            print(s.name, name, "splits", sp, "(auto", auto, ")", f"{us:.2f} us", flush=True)
    del case
    torch.cuda.empty_cache()
out["provenance"] = bench.provenance(bench.ceilings(dev))
o = pathlib.Path(os.environ.get("OUT", "out"))
o.mkdir(parents=True, exist_ok=True)
(o / "b1_probe.json").write_text(json.dumps(out, indent=1))
