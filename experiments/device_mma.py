"""Dev tool (GPU), one device call: validate SIMT and the tensor-core decode ("mma", the launch
rule's pick) on the GPU against the float64 reference, capture the decode in a CUDA graph, and
sweep configs of the portable tl.dot kernel (:class:`mla.configs.TlDotConfig`) at the SPEC's
shapes, writing the best per head bucket as a candidate table (h200.json, tl.dot only). Writes
device_mma.json and log.txt to $OUT (or ./out).

PHASES: a comma list of correct, sweep, correct_cfg (every swept config through
:mod:`mla.validate`; N_ODD odd cases), bench (:func:`mla.bench.run` of IMPLS with the candidate
table). SWEEP: JSON {"h64": [TlDotConfig kwargs...], "h16": [...]}, e.g. the lists in
experiments/sweep_*.json; PLAN: the shapes swept (small, mid, big, all, or the default mix);
AUTO=1 also times the launch rule's own pick.

The bf16-operand impls (``dot="bf16"``, ``p_split``), the sweep's ablation row (``ablate``,
NO_ABLATE) and the ``ctas_per_sm`` / ``partial_fp16`` config keys (with VALIDATE_NEW_ONLY) are
gone with those config fields; their code is at commit 38a926e.

    PHASES=correct,sweep SWEEP="$(cat experiments/sweep_small.json)" PLAN=small OUT=out \
        python experiments/device_mma.py
"""
import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402
import triton  # noqa: E402

from mla import api, bench, configs, dispatch  # noqa: E402
from mla.bench import Case, Shape  # noqa: E402
from mla.configs import TlDotConfig  # noqa: E402
from mla.validate import check_against_reference, poison_allocator, poison_unreferenced  # noqa: E402

OUT = pathlib.Path(os.environ.get("OUT", "out"))
dev = torch.device("cuda")
_log = None


def say(*a):
    """Print a line and append it to $OUT/log.txt (opened at the first line)."""
    global _log
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    if _log is None:
        OUT.mkdir(parents=True, exist_ok=True)
        _log = open(OUT / "log.txt", "a")
    _log.write(s + "\n")
    _log.flush()


def forced(config=None, splits=None):
    """A decode with the signature of :func:`mla.sparse_decode` that runs ``config`` (a
    :class:`~mla.configs.TlDotConfig` or :class:`~mla.configs.GluonConfig`; None: the launch
    rule's pick) with ``splits`` (None: the launch rule's count), through a plan made per call."""
    def fn(q, k_cache, indices, **kw):
        plan = mla.plan(q, k_cache, indices, **kw, config=config, programs=splits)
        return mla.sparse_decode(q, k_cache, indices, **kw, plan=plan)
    return fn


def caller(case, config=None, splits=None):
    """``call(i)`` for :func:`mla.bench.time_graph`: the decode of ``case``'s index set ``i``
    with ``config`` and ``splits`` forced (as :func:`forced`), through one plan made here, as a
    serving step would."""
    plan = mla.plan(case.q, case.cache, case.index_sets[0], **case.kwargs(0), config=config, programs=splits)
    return lambda i: mla.sparse_decode(case.q, case.cache, case.index_sets[i], **case.kwargs(i), plan=plan)


IMPLS = {
    "simt": lambda *a, **k: mla.sparse_decode(*a, **k, impl="simt"),
    "mma": lambda *a, **k: mla.sparse_decode(*a, **k, impl="mma"),
}


def correctness_case(name, b, s_q, h_q, topk, P, etopk=0, eP=64, nb=None, lens=False, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    nb = nb or max(4, (b * s_q * topk) // P // 2 + 3)
    cache = bench.random_cache(nb, P, dev, g)
    n = nb * P
    q = torch.randn(b, s_q, h_q, 512, device=dev, generator=g).bfloat16()
    idx = torch.randint(0, n, (b, s_q, topk), dtype=torch.int32, device=dev, generator=g)
    # invalid entries of every kind
    bad = torch.rand(b, s_q, topk, device=dev, generator=g) < 0.05
    kinds = torch.tensor([-1, -2 ** 31, 2 ** 31 - 1, n], dtype=torch.int32, device=dev)
    idx = torch.where(bad, kinds[torch.randint(0, 4, (b, s_q, topk), device=dev, generator=g)], idx)
    sink = torch.randn(h_q, device=dev, generator=g)
    sink[0] = float("inf")
    if h_q > 1:
        sink[1] = float("-inf")
    kw = dict(attn_sink=sink)
    used = [idx]
    if lens:
        tl_ = torch.randint(0, topk + 1, (b,), dtype=torch.int32, device=dev, generator=g)
        tl_[0] = 0
        kw["topk_length"] = tl_
        pos = torch.arange(topk, device=dev)
        used = [torch.where(pos.view(1, 1, -1) < tl_.view(-1, 1, 1), idx, -1)]
    if etopk:
        enb = max(4, (b * s_q * etopk) // eP // 2 + 3)
        ec = bench.random_cache(enb, eP, dev, g)
        eidx = torch.randint(-2, enb * eP + 2, (b, s_q, etopk), dtype=torch.int32, device=dev, generator=g)
        kw.update(extra_k_cache=ec, extra_indices=eidx)
        if lens:
            etl = torch.randint(0, etopk + 1, (b,), dtype=torch.int32, device=dev, generator=g)
            kw["extra_topk_length"] = etl
            pos = torch.arange(etopk, device=dev)
            eused = torch.where(pos.view(1, 1, -1) < etl.view(-1, 1, 1), eidx, -1)
        else:
            eused = eidx
        poison_unreferenced(ec, eused)
    poison_unreferenced(cache, used[0])
    ref_o, ref_l = mla.sparse_decode_reference(q, cache, idx, out_dtype=torch.float64, **kw)
    res = {}
    for impl, fn in IMPLS.items():
        poison_allocator(b * s_q * h_q * 512 * 4 * 4, dev)
        o, l = fn(q, cache, idx, **kw)
        torch.cuda.synchronize()
        co, cl = check_against_reference(o, l, ref_o, ref_l)
        res[impl] = {"out_ok": co.ok, "lse_ok": cl.ok, "out": str(co), "lse": str(cl)}
        say(f"[{'ok' if co.ok and cl.ok else 'FAIL'}] {name} {impl}: {co} | {cl}")
    return res


def graph_test():
    s = Shape("DSA", 8, 1, 64, 2048, 64)
    case = Case(s, dev, pool_bytes=2e8, n_sets=2)
    idx = case.index_sets[0].clone()
    fn = lambda: mla.sparse_decode(case.q, case.cache, idx, attn_sink=case.sink, impl="mma")  # noqa: E731
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o, l = fn()
    ok = True
    for i in range(2):
        idx.copy_(case.index_sets[i])
        g.replay()
        torch.cuda.synchronize()
        ro, rl = mla.sparse_decode_reference(case.q, case.cache, case.index_sets[i], attn_sink=case.sink,
                                             out_dtype=torch.float64)
        co, cl = check_against_reference(o, l, ro, rl)
        say(f"[{'ok' if co.ok and cl.ok else 'FAIL'}] graph replay set {i}: {co} | {cl}")
        ok &= co.ok and cl.ok
    return ok


def _candidates():
    """Configs to sweep: $SWEEP (JSON {"h64": [TlDotConfig kwargs...], "h16": [...]}) or the defaults."""
    spec = json.loads(os.environ.get("SWEEP", "null") or "null")
    if spec is None:
        return ([TlDotConfig(), TlDotConfig(num_stages=2), TlDotConfig(block_n=32)],
                [TlDotConfig(16, 64, 8), TlDotConfig(16, 64, 4), TlDotConfig(16, 32, 8),
                 TlDotConfig(16, 64, 8, num_stages=2)])
    return [TlDotConfig(**k) for k in spec["h64"]], [TlDotConfig(**k) for k in spec["h16"]]


def correct_configs(results):
    """Every swept config through mla.validate on the quick cases and the first odd cases."""
    from mla import validate

    h64, h16 = _candidates()
    fns = {str(cfg): forced(cfg) for cfg in h64 + h16}
    cases = validate.quick_cases() + validate.odd_cases()[:int(os.environ.get("N_ODD", "10"))]
    rep = validate.validate(fns, cases, progress=False)
    s = rep.summary
    results["config_validation"] = s
    say(f"config validation: {s['rows']} rows, {s['failures']} failures, crashes {s['crashes']}, "
        f"worst out excess {s['worst_out_excess']:.2f}")
    for f in s["failed"][:20]:
        say("  FAILED", f)
    return s["failures"] == 0 and s["crashes"] == 0


def sweep(ceil, results):
    h64, h16 = _candidates()
    if os.environ.get("PLAN") == "small":
        dsa = [Shape("DSA", b, 1, 64, 2048, 64) for b in (1, 2, 4, 8)]
        csa = [Shape("V4-CSA", b, 1, 64, 128, 256, 512, 64) for b in (1, 2, 4, 8)]
        tp8 = [Shape("V4-TP8", b, 1, 8, 128, 256, 512, 64) for b in (1, 4)]
        plan = [(s, h64) for s in dsa + csa] + [(s, h16) for s in tp8]
    elif os.environ.get("PLAN") == "all":
        plan = [(s, h16 if s.h_q <= 16 else h64) for s in bench.spec_shapes()]
    elif os.environ.get("PLAN") == "big":
        plan = [(Shape("DSA", 128, 1, 64, 2048, 64), h64), (Shape("V4-CSA", 128, 1, 64, 128, 256, 512, 64), h64)]
    elif os.environ.get("PLAN") == "mid":
        plan = [(Shape("DSA", b, 1, 64, 2048, 64), h64) for b in (8, 32, 64)]
        plan += [(Shape("V4-CSA", 32, 1, 64, 128, 256, 512, 64), h64), (Shape("V4-TP8", 32, 1, 8, 128, 256, 512, 64), h16)]
    else:
        plan = [(Shape("DSA", 32, 1, 64, 2048, 64), h64), (Shape("DSA", 128, 1, 64, 2048, 64), h64),
                (Shape("DSA", 1, 1, 64, 2048, 64), h64), (Shape("V4-CSA", 128, 1, 64, 128, 256, 512, 64), h64),
                (Shape("V4-CSA", 1, 1, 64, 128, 256, 512, 64), h64),
                (Shape("V4-TP8", 1, 1, 8, 128, 256, 512, 64), h16), (Shape("V4-TP8", 32, 1, 8, 128, 256, 512, 64), h16),
                (Shape("V4-TP8", 128, 1, 8, 128, 256, 512, 64), h16)]
    score = {}
    for s, cfgs in plan:
        case = Case(s, dev, pool_bytes=2e9, n_sets=16)
        if os.environ.get("AUTO"):
            us = bench.time_graph(case, case.caller("mma"))
            rec = bench.record(s, "mma", us, None, ceil)
            rec["config"] = "auto (mla.sparse_decode default)"
            results["sweep"].append(rec)
            say(f"{s.name:7s} b{s.b:<4d} {us:8.1f} us roof {rec['roofline']:.2f} auto")
        for cfg in cfgs:
            c2 = cfg.for_heads(s.h_q)
            try:
                us = bench.time_graph(case, caller(case, c2))
                rec = bench.record(s, "mma", us, None, ceil)
                rec["config"] = dataclasses.asdict(c2)
                results["sweep"].append(rec)
                fm = bench.FLASHMLA_H200_US.get((s.name, s.b))
                say(f"{s.name:7s} b{s.b:<4d} {us:8.1f} us roof {rec['roofline']:.2f} FlashMLA {fm}  {c2}")
                key = (16 if s.h_q <= 16 else 64, cfg)      # a candidate for the shipped table
                score[key] = score.get(key, 0.0) + math.log(us)
            except Exception as e:  # noqa: BLE001
                say(f"{s.name} b{s.b} {c2}: ERROR {type(e).__name__}: {str(e)[:300]}")
        del case
        torch.cuda.empty_cache()
    best = {}
    for (bucket, cfg), sc in score.items():
        if bucket not in best or sc < best[bucket][1]:
            best[bucket] = (cfg, sc)
    if 16 not in best or 64 not in best:
        return None
    table = {16: best[16][0], 32: dataclasses.replace(best[16][0], block_h=32), 64: best[64][0], 128: best[64][0]}
    path = OUT / "h200.json"        # tl.dot only ("gluon": false): a bench phase after it times tl.dot
    configs.write(path, torch.cuda.get_device_name(), triton.__version__, table,
                  measured="experiments/device_mma.py sweep (geometric mean of CUDA-graph us over its shapes)")
    say("candidate table", {k: str(v) for k, v in table.items()})
    return path


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if mla.INTERPRET:
        sys.exit("device_mma: needs a CUDA GPU; here mla runs Triton's CPU interpreter")
    say("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    phases = os.environ.get("PHASES", "correct,sweep").split(",")
    results = {"correctness": {}, "sweep": []}
    t0 = time.time()
    if "correct" in phases:
        cases = [("DSA b1", 1, 1, 64, 2048, 64), ("DSA b8", 8, 1, 64, 2048, 64), ("DSA b32", 32, 1, 64, 2048, 64),
                 ("DSA s_q2 b4", 4, 2, 64, 2048, 64), ("odd P61 topk100 h8", 3, 2, 8, 100, 61),
                 ("odd h1 topk1 P1", 2, 1, 1, 1, 1), ("odd h128", 2, 1, 128, 300, 64),
                 ("odd h20 topk77", 3, 3, 20, 77, 33)]
        for c in cases:
            results["correctness"][c[0]] = correctness_case(*c)
        for name, b, h in (("V4-CSA b4", 4, 64), ("V4-TP8 b4", 4, 8), ("V4-CSA b32", 32, 64)):
            results["correctness"][name] = correctness_case(name, b, 1, h, 128, 256, 512, 64)
        for name, b, h in (("V4-CSA lens b5", 5, 64), ("odd lens h3", 4, 3)):
            results["correctness"][name + " +lens"] = correctness_case(name, b, 2, h, 100, 61, 70, 13, lens=True)
        results["graph_ok"] = graph_test()
        say(f"correctness done in {time.time() - t0:.0f}s")
    ceil = bench.ceilings(dev)
    results["ceilings"] = ceil
    say("ceilings", ceil)
    if "sweep" in phases:
        path = sweep(ceil, results)
        if path:        # the candidate table from here on: drop the launch rule's cached tables and plans
            os.environ["MLA_CONFIG_FILE"] = str(path)
            configs.table_for.cache_clear()
            configs.gluon_for.cache_clear()
            dispatch._device_facts.cache_clear()
            api._PLANS.clear()
    results["provenance"] = bench.provenance(ceil)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "device_mma.json").write_text(json.dumps(results, indent=1))
    if "correct_cfg" in phases:
        results["config_validation_ok"] = correct_configs(results)
        (OUT / "device_mma.json").write_text(json.dumps(results, indent=1))
    if "bench" in phases:
        res = bench.run(out_dir=str(OUT), progress=False, impls=tuple(os.environ.get("IMPLS", "mma").split(",")))
        say(bench.table(res["records"]))
    say(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
