"""Dev tool (GPU): variants of the Gluon kernel against the reference on small cases (CHECK=1,
the default; at the launch's split count and at 3 splits), then timed (CUDA graph, median) at
SPEC shapes (SHAPES, e.g. "DSA:32,V4-CSA:128"; empty for checks only), ROUNDS times each,
alternating between the variants (default once). VARIANTS: JSON {name: MMAConfig kwargs}; a
variant's "nst" key, if any, sets the Gluon kernel's ring stages (mla.kernels.wgmma.NUM_STAGES)
while that variant runs; its "combine" key, if any, updates mla.kernels.mma.COMBINE (the combine
kernel's launch) likewise; its "splits" key, if any, fixes the split count of its timed calls; its
"shapes" key, if any, lists the SHAPES entries it is timed at; its "wgmma" key, if any, sets
constants of mla.kernels.wgmma (e.g. {"PRODUCER_REGS": 56}) while it runs."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import device_mma as dm  # noqa: E402
import torch  # noqa: E402

from mla import bench  # noqa: E402
from mla.bench import Case  # noqa: E402
from mla.kernels import mma, wgmma  # noqa: E402
from mla.kernels.mma import MMAConfig, mma_sparse_decode  # noqa: E402

variants = json.loads(os.environ["VARIANTS"])
mods = {name: kw.pop("wgmma", {}) for name, kw in variants.items()}   # optional: mla.kernels.wgmma constants
for name, kw in variants.items():    # "nst" is short for the ring stages of every form
    if kw.get("nst"):
        mods[name] = {"NUM_STAGES": kw["nst"], "DUO_STAGES": kw["nst"], **mods[name]}
    kw.pop("nst", None)
nst = {name: kw.get("NUM_STAGES") for name, kw in mods.items()}          # recorded with each timing
only = {name: kw.pop("shapes", None) for name, kw in variants.items()}   # optional: the SHAPES a variant runs at
comb = {name: kw.pop("combine", None) for name, kw in variants.items()}   # optional: mla.kernels.mma.COMBINE
nsp = {name: kw.pop("splits", None) for name, kw in variants.items()}    # optional: a fixed split count


def run(name, *a, **k):
    """One call of variant ``name``, with its module constants (ring stages and the like),
    combine launch and split count (if set) in force."""
    cfg = MMAConfig(**variants[name])
    saved_m, saved_c = {key: getattr(wgmma, key) for key in mods[name]}, dict(mma.COMBINE)
    for key, val in mods[name].items():
        setattr(wgmma, key, val)
    mma.COMBINE.update(comb[name] or {})
    try:
        if nsp[name] is not None and "splits" not in k:
            k["splits"] = nsp[name]
        return mma_sparse_decode(*a, **k, config=cfg)
    finally:
        for key, val in saved_m.items():
            setattr(wgmma, key, val)
        mma.COMBINE.update(saved_c)


check = [n for n, k in variants.items() if not k.get("ablate", 0)]   # ablations' results are wrong
dm.IMPLS.clear()
for name in check:
    dm.IMPLS[name] = lambda *a, _n=name, **k: run(_n, *a, **k)
    dm.IMPLS[name + "-s3"] = lambda *a, _n=name, **k: run(_n, *a, **k, splits=3)
fails = 0
results = {"correctness": {}, "timing": []}
if os.environ.get("CHECK", "1") == "1":
    for c in [("DSA b2", 2, 1, 64, 2048, 64), ("odd h1 topk1 P1", 2, 1, 1, 1, 1), ("odd h128", 2, 1, 128, 300, 64),
              ("odd h20 topk77", 3, 3, 20, 77, 33)]:
        r = dm.correctness_case(*c)
        results["correctness"][c[0]] = r
        fails += sum(not (v["out_ok"] and v["lse_ok"]) for v in r.values())
    for c in [("V4-CSA b4", 4, 1, 64, 128, 256, 512, 64), ("V4-TP8 b4", 4, 1, 8, 128, 256, 512, 64)]:
        r = dm.correctness_case(*c)
        results["correctness"][c[0]] = r
        fails += sum(not (v["out_ok"] and v["lse_ok"]) for v in r.values())
    for c in [("V4-CSA lens b5", 5, 2, 64, 100, 61, 70, 13), ("V4-TP8 lens b5 h5", 5, 2, 5, 100, 61, 70, 13)]:
        r = dm.correctness_case(*c, lens=True)
        results["correctness"][c[0]] = r
        fails += sum(not (v["out_ok"] and v["lse_ok"]) for v in r.values())
    dm.say("probe correctness failures:", fails)
results["failures"] = fails
shapes = {f"{s.name}:{s.b}": s for s in bench.spec_shapes() if s.s_q == 1}
ceil = bench.ceilings(dm.dev)
for spec in filter(None, os.environ.get("SHAPES", "DSA:32,DSA:128,V4-CSA:128").split(",")):
    s = shapes[spec]
    nm, b = s.name, s.b
    case = Case(s, dm.dev, pool_bytes=2e9, n_sets=16)
    rounds = int(os.environ.get("ROUNDS", "1"))
    for rnd, (name, kw) in [(r, v) for r in range(rounds) for v in variants.items()]:
        if only[name] is not None and spec not in only[name]:
            continue
        try:
            us = bench.time_graph(case, lambda *a, _n=name, **k: run(_n, *a, **k))
        except Exception as e:  # noqa: BLE001
            dm.say(f"{nm} b{b} {name}: ERROR {type(e).__name__}: {str(e)[:300]}")
            continue
        fm = bench.FLASHMLA_H200_US.get((s.name, s.b))
        dm.say(f"{nm:7s} b{b:<4} {name:24s} {us:8.1f} us   FlashMLA {fm}")
        results["timing"].append({"shape": nm, "b": int(b), "variant": name, "config": kw, "nst": nst[name],
                                   "round": rnd, "us_graph": us})
    del case
    torch.cuda.empty_cache()
results["provenance"] = bench.provenance(ceil)
(dm.OUT / "ring_probe.json").write_text(json.dumps(results, indent=1))
