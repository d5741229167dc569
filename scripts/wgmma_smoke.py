"""Dev tool (GPU): the Gluon wgmma kernel against the reference on small cases, in its own
process so that a fault cannot take the rest of a device call with it."""
import sys
import os
sys.path.insert(0, os.path.dirname(__file__))
import device_mma as dm  # noqa: E402
from mla.kernels.mma import MMAConfig, mma_sparse_decode  # noqa: E402

dm.IMPLS.clear()
for name, cfg in (("bn64", MMAConfig(kernel="wgmma")),):
    dm.IMPLS[f"wgmma-{name}"] = lambda *a, _c=cfg, **k: mma_sparse_decode(*a, **k, config=_c)
    dm.IMPLS[f"wgmma-{name}-s3"] = lambda *a, _c=cfg, **k: mma_sparse_decode(*a, **k, config=_c, splits=3)
fails = 0
for c in [("DSA b2", 2, 1, 64, 2048, 64), ("odd h1 topk1 P1", 2, 1, 1, 1, 1), ("odd h128", 2, 1, 128, 300, 64),
          ("odd h20 topk77", 3, 3, 20, 77, 33)]:
    r = dm.correctness_case(*c)
    fails += sum(not (v["out_ok"] and v["lse_ok"]) for v in r.values())
r = dm.correctness_case("V4-CSA b4", 4, 1, 64, 128, 256, 512, 64)
fails += sum(not (v["out_ok"] and v["lse_ok"]) for v in r.values())
r = dm.correctness_case("V4-CSA lens b5", 5, 2, 64, 100, 61, 70, 13, lens=True)
fails += sum(not (v["out_ok"] and v["lse_ok"]) for v in r.values())
dm.say("wgmma smoke failures:", fails)
