"""The GPU validation sweep of chapter 6: every counted impl on the SPEC's benchmark shapes (over a
pool of about 0.5 GB) and on the odd-shape grid, against the float64 reference, with NaN in every
unreferenced cache byte and a second call with zeros there (the result must not change).

    python scripts/gpu_validation.py [--out DIR] [--workers 8] [--pool-gb 0.5] [--budget-s 170]

Writes DIR/validation.json (DIR defaults to $OUT, else results/<gpu-slug>/):
``{"provenance", "summary", "records", "informational", "graph_replay"}``. ``summary.failures``
must be 0. The cases run in several worker processes on the one GPU so that Triton compiles the
many specializations the odd shapes need in parallel; a case that crashes is a failed row with
its message; cases not started before the time budget ends are listed as skipped (and
``summary.complete`` is false). ``informational`` holds runs that are expected to fail and are
not counted: the MMA kernel with bf16 tensor-core operands (P rounded to 2**-8), and a range
probe with |q| beyond the fp16 range. "mma" is what a serving call runs (the launch rule picks
the kernel per call); "mma-tl" and "mma-wgmma*" force one kernel on every case: the portable
tl.dot kernel with its shipped configs, and on sm_90 the Gluon kernel's four forms
(mla.configs.GLUON_FORMS); "mma-tl-sm80" and "mma-tl-sm89" the portable kernel as an A100 and an
L40 compile it (their generic tables, mla.kernels.cross_arch), on the GPU in hand; "mma-gp*" the
portable Gluon kernel (mla.kernels.gluon_portable), this GPU's code and those two's;
"mma-wgmma-cluster" the Gluon kernel's 2-CTA cluster form (MODEL1, where Triton builds it: 3.9 and
newer; 128 heads a cluster, so that fewer heads leave CTA 1's heads masked). The check is
FlashMLA's whole check, the cosine difference included. DeepSeek-V3.2's cases
(mla.validate.v32_cases, the set "v32") run every counted impl but the Gluon ones (the Hopper
kernel's and the portable one's): they read the MODEL1 cache only, and "mma" runs the tl.dot
kernel there.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402
import triton  # noqa: E402

import mla.validate as mv  # noqa: E402
from mla import bench, dispatch  # noqa: E402
from mla.configs import ClusterConfig, GluonConfig  # noqa: E402
from mla.layout import layout_for_head_dim  # noqa: E402

# "reference": fp32
COUNTED = ("reference", "simt", "mma", "mma-tl", "mma-tl-sm80", "mma-tl-sm89", "mma-gp", "mma-gp-sm80",
           "mma-gp-sm89", "mma-wgmma", "mma-wgmma-t16", "mma-wgmma-t8", "mma-wgmma-duo", "mma-wgmma-cluster")
GLUON = {"mma-wgmma": "heads as M", "mma-wgmma-t16": "tokens as M, 16 x 64", "mma-wgmma-t8": "tokens as M, 8 x 128",
         "mma-wgmma-duo": "tokens as M, two consumers"}
#: the portable kernel as an A100 and an L40 compile it, run on this (newer) GPU
OTHER_ISAS = {"mma-tl-sm80": 80, "mma-tl-sm89": 89}
#: the portable Gluon kernel: this GPU's code (0), or an A100's and an L40's
GLUON_PORTABLE = {"mma-gp": 0, "mma-gp-sm80": 80, "mma-gp-sm89": 89}
#: the Gluon kernel's 128-head form as a 2-CTA cluster (MODEL1; Triton 3.9 and newer)
CLUSTER = "mma-wgmma-cluster"
INFO_IMPLS = ("mma-bf16",)


def _forced(config_for, q, k_cache, indices, **kw):
    """mla.sparse_decode with the launch forced to ``config_for(q, indices, kw)``'s config."""
    return mla.sparse_decode(q, k_cache, indices, **kw, plan=mla.plan(q, k_cache, indices, **kw, impl="mma",
                                                                      config=config_for(q, indices, kw)))


def _tl_config(q, indices, kw):
    """The portable tl.dot kernel with its shipped config (two programs per head block on small grids)."""
    b, s_q, h_q, _ = q.shape
    total = indices.shape[-1] + (kw["extra_indices"].shape[-1] if kw.get("extra_k_cache") is not None else 0)
    return dispatch.tl_dot_launch_config(q.device, b, s_q, h_q, total)


def _other_isa(isa, q, k_cache, indices, **kw):
    """mla.sparse_decode with the portable kernel as sm_``isa`` compiles it (its generic table)."""
    return mla.sparse_decode(q, k_cache, indices, **kw, plan=mla.plan(q, k_cache, indices, **kw, impl="mma", isa=isa))


def _gluon_portable(isa, q, k_cache, indices, **kw):
    """mla.sparse_decode with the portable Gluon kernel in the form that fits sm_``isa``'s shared
    memory (0: this GPU's code), compiled for that architecture."""
    arch = isa or 10 * torch.cuda.get_device_capability(q.device)[0]
    cfg = dispatch.gluon_portable_config(arch, q.shape[2])
    return mla.sparse_decode(q, k_cache, indices, **kw,
                             plan=mla.plan(q, k_cache, indices, **kw, impl="mma", config=cfg, isa=isa))


def _gluon(form):
    return lambda q, indices, kw: GluonConfig(form)


def _bf16_operands(q, k_cache, indices, **kw):
    """The tl.dot kernel with its shipped config but bf16 tensor-core operands (P rounded to 2**-8)."""
    b, s_q, h_q, _ = q.shape
    out = torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    plan = mla.plan(q, k_cache, indices, **kw, impl="mma", config=dispatch.tl_dot_config(q.device, h_q))
    launcher = plan.launcher
    launcher.kwargs["DOT"] = triton.language.bfloat16     # in place: the plan's launches hold this dict
    launcher(q, k_cache, indices, kw.get("attn_sink"), kw.get("topk_length"), kw.get("extra_k_cache"),
             kw.get("extra_indices"), kw.get("extra_topk_length"), out, lse)
    return out, lse


def _impls(names):
    forced = {"mma-bf16": _bf16_operands, "mma-tl": functools.partial(_forced, _tl_config),
              **{n: functools.partial(_forced, _gluon(form)) for n, form in GLUON.items()},
              **{n: functools.partial(_other_isa, isa) for n, isa in OTHER_ISAS.items()},
              **{n: functools.partial(_gluon_portable, isa) for n, isa in GLUON_PORTABLE.items()},
              CLUSTER: functools.partial(_forced, lambda q, indices, kw: ClusterConfig())}
    return {n: forced.get(n) or functools.partial(mla.sparse_decode, impl=n) for n in names}


def _jsonable(v):
    if v is None or isinstance(v, (bool, str)):
        return v
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float):
        return v if math.isfinite(v) else (None if math.isnan(v) else str(v))
    return v


def _records(rows):
    return [{k: _jsonable(v) for k, v in r.items()} for r in rows]


def impls_for(spec, names) -> tuple:
    """The impls a case runs: all of ``names`` but the forced Gluon forms its cache's layout does
    not have (mla.dispatch.GLUON_LAYOUTS: V3.2's has heads as M only) and, for a layout the
    portable Gluon kernel does not read (mla.dispatch.PORTABLE_LAYOUTS), that kernel."""
    layout = layout_for_head_dim(spec.d_qk)
    forms = dispatch.GLUON_LAYOUTS.get(layout, ())
    return tuple(n for n in names if (n not in GLUON or GLUON[n] in forms)
                 and ((n not in GLUON_PORTABLE and n != CLUSTER) or layout in dispatch.PORTABLE_LAYOUTS))


def _work(job):
    """One worker: run its cases (each a dict of CaseSpec fields) until the deadline."""
    specs, names, deadline, leak, wid, device = job
    rows, skipped = [], []
    for d in specs:
        spec = mv.CaseSpec(**d)
        if time.time() > deadline:
            skipped.append(spec.name)
            continue
        t0 = time.time()
        here = impls_for(spec, names)
        try:
            got = mv.sweep_rows(_impls(here), [spec], device, progress=False, leak_check=leak)
        except Exception as e:  # noqa: BLE001  (sweep catches per call; this is the last net)
            got = [mv._error_row(spec, n, f"worker: {type(e).__name__}: {e}"[:400]) for n in here]
        rows += _records(got)
        bad = sum(not r["ok"] for r in got)
        print(f"[w{wid}] {spec.name}: {len(got) - bad}/{len(got)} ok, {time.time() - t0:.1f}s", flush=True)
    return rows, skipped


def _run_pool(jobs, workers):
    if workers <= 1:
        return [_work(j) for j in jobs]
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        return pool.map(_work, jobs, chunksize=1)


def _split(specs, workers):
    """Round-robin after sorting by cost, so that every worker gets a share of the heavy cases."""
    cost = sorted(specs, key=lambda s: -(s.b * s.s_q * s.h_q * (s.topk + s.extra_topk)))
    return [[dataclasses.asdict(s) for s in cost[i::workers]] for i in range(workers)]


def graph_replay_check():
    """The MMA call captured once in a CUDA graph, replayed over new index sets, each checked: a
    small grid (b 4; on sm_90 the Gluon kernel with tokens as M, elsewhere the tl.dot kernel),
    one that fills the GPU (b 32; on sm_90 heads as M), 8 heads at b 128 (on sm_90 8 heads x
    128-token tiles) and a V3.2 cache (the tl.dot kernel everywhere)."""
    runs = {}
    for b, h_q in ((4, 64), (32, 64), (128, 8)):
        case = mv.make_case(b=b, s_q=1, h_q=h_q, topk=512, page=64, num_blocks=256, extra_topk=64, extra_page=64,
                            device="cuda", seed=11, invalid_frac=0.05)
        runs[f"b{b} h{h_q}"] = mv.graph_replay_check(case)
    case = mv.make_case(b=32, s_q=2, h_q=128, topk=2048, page=64, num_blocks=1024, device="cuda", seed=12,
                        invalid_frac=0.05, d_qk=576)                       # V3.2's cache: the tl.dot kernel
    runs["V3.2 b32 s_q2 h128"] = mv.graph_replay_check(case)
    return {"ok": all(r["ok"] for r in runs.values()), "runs": runs}


def _safe_summary(rows):
    try:
        return mv.summary(rows) if rows else {}
    except Exception as e:  # noqa: BLE001  (informational rows may hold error strings)
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default $OUT, else results/<gpu>)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--pool-gb", type=float, default=0.5)
    ap.add_argument("--budget-s", type=float, default=150.0, help="no new case starts after this many seconds")
    ap.add_argument("--no-leak-check", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a few cases only (a smoke test of the script)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script on the interpreter")
    ap.add_argument("--impls", type=lambda v: tuple(v.split(",")), default=COUNTED,
                    help="the counted impls to run, comma-separated (default: all of them: %s); a change to one "
                         "kernel may validate only the impls that run it" % ",".join(COUNTED))
    a = ap.parse_args(argv)
    unknown = [n for n in a.impls if n not in COUNTED]
    if unknown:
        ap.error(f"--impls: {', '.join(unknown)} not among {', '.join(COUNTED)}")
    t_start = time.time()
    on_gpu = a.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("gpu_validation: no CUDA GPU", file=sys.stderr)
        return 2
    deadline = t_start + a.budget_s
    bench_specs = mv.benchmark_cases(pool_bytes=a.pool_gb * 1e9)
    odd_specs = mv.odd_cases()
    sched_specs = mv.schedule_cases() if on_gpu else []
    v32_specs = mv.v32_cases(pool_bytes=a.pool_gb * 1e9) if on_gpu else []
    if a.quick:
        bench_specs, odd_specs = (bench_specs[:1], odd_specs[:3]) if on_gpu else ([], mv.quick_cases()[:4])
        sched_specs = sched_specs[:2]
        v32_specs = v32_specs[:1] if on_gpu else [mv.CaseSpec("V3.2 quick", b=2, s_q=2, h_q=4, topk=40, page=16,
                                                              lengths=True, d_qk=576, seed=7)]
    info_specs = [s for s in odd_specs if s.topk + s.extra_topk <= 120 and s.h_q >= 8][:8]
    info_specs.append(mv.CaseSpec("range probe |q| ~ 1e5 (beyond fp16)", b=1, s_q=1, h_q=16, topk=64, page=64,
                                  q_scale=3e4, sink_inf=False, seed=400))
    info_specs = [dataclasses.replace(s, name="info: " + s.name) for s in info_specs]
    w = max(1, a.workers)
    counted_impls = a.impls
    if not (on_gpu and torch.cuda.get_device_capability() == (9, 0)):     # the Gluon kernel is sm_90 only
        counted_impls = tuple(n for n in counted_impls if n not in GLUON and n != CLUSTER)
    if dispatch.gluon_cluster is None:      # this Triton cannot build it
        counted_impls = tuple(n for n in counted_impls if n != CLUSTER)
    if not on_gpu:                      # another architecture's code, and Gluon, run on a GPU only
        counted_impls = tuple(n for n in counted_impls if n not in OTHER_ISAS and n not in GLUON_PORTABLE)
    jobs = [(sp, counted_impls, deadline, not a.no_leak_check, i, a.device)
            for i, sp in enumerate(_split(bench_specs + sched_specs + v32_specs + odd_specs, w))]
    jobs += [(sp, INFO_IMPLS + ("mma",), deadline, False, w + i, a.device) for i, sp in enumerate(_split(info_specs, 2))]
    print(f"{len(bench_specs)} benchmark + {len(sched_specs)} schedule + {len(v32_specs)} V3.2 + {len(odd_specs)} odd "
          f"cases x {counted_impls}, {len(info_specs)} informational; {w} workers", flush=True)
    results = _run_pool([j for j in jobs if j[0]], w)
    rows, info_rows, skipped, info_skipped = [], [], [], []
    for job, (r, sk) in zip([j for j in jobs if j[0]], results):
        counted = job[1] == counted_impls
        (rows if counted else info_rows).extend(r)
        (skipped if counted else info_skipped).extend(sk)
    kind = ({s.name: "benchmark" for s in bench_specs} | {s.name: "schedule" for s in sched_specs}
            | {s.name: "v32" for s in v32_specs} | {s.name: "odd" for s in odd_specs})
    for r in rows:
        r["set"] = kind.get(r["case"])
    try:
        graph = graph_replay_check() if on_gpu else {"ok": True, "note": "not run (no GPU)"}
    except Exception as e:  # noqa: BLE001
        graph = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    summ = mv.summary(rows)
    summ.update(impls=list(counted_impls), skipped=skipped, complete=not skipped, graph_replay_ok=graph["ok"],
                benchmark_cases=len(bench_specs), schedule_cases=len(sched_specs), v32_cases=len(v32_specs),
                odd_cases=len(odd_specs), pool_bytes=a.pool_gb * 1e9,
                gluon_skipped_v32=sorted(set(counted_impls) - set(impls_for(v32_specs[0], counted_impls)))
                if v32_specs else [],
                seconds=round(time.time() - t_start, 1))
    info = {"about": "not counted: mma-bf16 is the MMA kernel with bf16 tensor-core operands (P rounded to "
                     "2**-8), expected to fail the SPEC's out tolerance where few tokens are valid; the range probe "
                     "has |q| beyond fp16's 65504 (fp16 operands overflow there; bf16 q of that size is not "
                     "expected from the model)",
            "summary": _safe_summary(info_rows), "records": _records(info_rows),
            "skipped": info_skipped}
    if on_gpu:
        prov = bench.provenance({})
        out_dir = pathlib.Path(a.out) if a.out else ROOT / "results" / bench.gpu_slug(prov["gpu"])
    else:
        prov = {"gpu": "none (CPU interpreter smoke test)", "torch": torch.__version__}
        out_dir = pathlib.Path(a.out or "/tmp/gpu_validation_smoke")
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"provenance": prov, "summary": summ, "records": _records(rows), "informational": info,
           "graph_replay": graph}
    path = out_dir / "validation.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(mv.table(rows, "GPU validation", width=200))
    if info_rows:
        print(mv.table(info_rows, "informational (not counted)", width=200))
    print(json.dumps({k: summ[k] for k in ("cases", "rows", "failures", "crashes", "worst_out_abs", "worst_out_rel",
                                           "worst_out_cos", "worst_lse_abs", "worst_lse_rel", "worst_lse_cos",
                                           "nan_leak_checks", "complete",
                                           "graph_replay_ok", "seconds")}, indent=1))
    print(f"wrote {path}")
    return 0 if summ["failures"] == 0 and graph["ok"] and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
