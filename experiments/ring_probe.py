"""Dev tool (GPU): variants of the Gluon kernel (or of the tl.dot kernel) against the reference on
small cases (CHECK=1, the default; at the launch's split count and at 3 splits), then timed (CUDA
graph, median) at SPEC shapes (SHAPES, e.g. "DSA:32,V4-CSA:128"; empty for checks only), ROUNDS
times each, alternating between the variants (default once). Writes ring_probe.json to $OUT.

VARIANTS: JSON {name: spec}. A spec's "form" key, if any, names a Gluon form
(:data:`mla.configs.GLUON_FORMS`, a :class:`~mla.configs.GluonConfig`); without one, the rest of
the spec is :class:`~mla.configs.TlDotConfig` kwargs. Its "nst" key, if any, sets the Gluon
kernel's ring stages (``mla.kernels.gluon_sm90.kernel.STAGES``) while that variant's plans are
made; its "gluon" key, if any, sets other constants of that module that
:func:`~mla.kernels.gluon_sm90.kernel.launch_options` reads (:data:`CONSTANTS`, e.g.
{"PRODUCER_REGS": 56}) likewise; its "splits" key, if any, fixes its split count; its "shapes"
key, if any, lists the SHAPES entries it is timed at. The "combine" key (the combine kernel's
launch) and the "ablate" key (timing ablations) are gone with the mutable combine launch and the
kernels' ablation bits; their code is at commit 38a926e.

    VARIANTS='{"t8": {"form": "tokens as M, 8 x 128"}, "t8-3st": {"form": "tokens as M, 8 x 128", "nst": 3}}' \\
        SHAPES=V4-TP8:128 ROUNDS=2 OUT=out python experiments/ring_probe.py
"""
import argparse
import contextlib
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402

from experiments import device_mma as dm  # noqa: E402
from mla import bench  # noqa: E402
from mla.bench import Case  # noqa: E402
from mla.configs import GluonConfig, TlDotConfig  # noqa: E402

#: the constants of mla.kernels.gluon_sm90.kernel that launch_options reads (when a plan is made)
CONSTANTS = ("NUM_WARPS", "PRODUCER_REGS", "STAGES", "PAIR_REGS", "GROUP_MAJOR")


@contextlib.contextmanager
def gluon_constants(values):
    """The Gluon kernel's launch constants (:data:`CONSTANTS`) set to ``values`` inside the block:
    a plan made there takes its constexprs from them."""
    bad = sorted(set(values) - set(CONSTANTS))
    if bad:
        raise ValueError(f"VARIANTS: {bad} are not launch constants of the Gluon kernel; those are {CONSTANTS}")
    from mla.kernels.gluon_sm90 import kernel as gk

    saved = {key: getattr(gk, key) for key in values}
    try:
        for key, val in values.items():
            setattr(gk, key, val)
        yield
    finally:
        for key, val in saved.items():
            setattr(gk, key, val)


def parse(variants: dict) -> dict:
    """{name: (config, Gluon constants, fixed splits or None, SHAPES entries or None, the spec)}."""
    out = {}
    for name, spec in variants.items():
        kw = dict(spec)
        consts = dict(kw.pop("gluon", {}))
        if kw.get("nst"):
            consts["STAGES"] = kw["nst"]
        kw.pop("nst", None)
        shapes, splits = kw.pop("shapes", None), kw.pop("splits", None)
        if "wgmma" in kw:
            raise ValueError(f"VARIANTS[{name!r}]: the 'wgmma' key (module constants) is now 'gluon'")
        for gone in ("combine", "ablate"):
            if gone in kw:
                raise ValueError(f"VARIANTS[{name!r}]: the {gone!r} key is gone (see this script's docstring)")
        cfg = GluonConfig(kw.pop("form")) if "form" in kw else TlDotConfig(**kw)
        if cfg.kernel == "gluon" and kw:
            raise ValueError(f"VARIANTS[{name!r}]: a Gluon form takes no other config keys, got {sorted(kw)}")
        out[name] = (cfg, consts, splits, shapes, spec)
    return out


def run(variant, *a, splits=None, **k):
    """One call of ``variant`` (from :func:`parse`), its Gluon constants in force while its plan
    is made, at ``splits`` or else its own split count (if set)."""
    cfg, consts, nsp, _, _ = variant
    with gluon_constants(consts):
        return dm.forced(cfg, splits if splits is not None else nsp)(*a, **k)


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if mla.INTERPRET:
        sys.exit("ring_probe: needs a CUDA GPU; here mla runs Triton's CPU interpreter")
    variants = parse(json.loads(os.environ["VARIANTS"]))
    dm.IMPLS.clear()
    for name, v in variants.items():
        dm.IMPLS[name] = lambda *a, _v=v, **k: run(_v, *a, **k)
        dm.IMPLS[name + "-s3"] = lambda *a, _v=v, **k: run(_v, *a, **k, splits=3)
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
    rounds = int(os.environ.get("ROUNDS", "1"))
    for spec in filter(None, os.environ.get("SHAPES", "DSA:32,DSA:128,V4-CSA:128").split(",")):
        s = shapes[spec]
        case = Case(s, dm.dev, pool_bytes=2e9, n_sets=16)
        for rnd, (name, (cfg, consts, nsp, only, kw)) in [(r, v) for r in range(rounds) for v in variants.items()]:
            if only is not None and spec not in only:
                continue
            try:
                with gluon_constants(consts):
                    call = dm.caller(case, cfg, nsp)
                us = bench.time_graph(case, call)
            except Exception as e:  # noqa: BLE001
                dm.say(f"{s.name} b{s.b} {name}: ERROR {type(e).__name__}: {str(e)[:300]}")
                continue
            fm = bench.FLASHMLA_H200_US.get((s.name, s.b))
            dm.say(f"{s.name:7s} b{s.b:<4} {name:24s} {us:8.1f} us   FlashMLA {fm}")
            results["timing"].append({"shape": s.name, "b": int(s.b), "variant": name, "config": kw,
                                      "nst": consts.get("STAGES"), "round": rnd, "us_graph": us})
        del case
        torch.cuda.empty_cache()
    results["provenance"] = bench.provenance(ceil)
    dm.OUT.mkdir(parents=True, exist_ok=True)
    (dm.OUT / "ring_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
