"""Dev probe (GPU): where an eager call's wall time goes. At the shapes whose eager loop is
furthest from their CUDA-graph time, back-to-back loops (no sync inside, median of 3) of:

- ``full``: the benchmark's planned call (``mla.bench.Case.caller("mma")``, out and lse allocated);
- ``planned_out``: the same with ``out=`` and ``lse=`` given;
- ``launcher``: the plan's :class:`mla.dispatch.Launcher` alone (no signature check);
- ``launches_c``: the decode and combine through their compiled kernels' C launchers alone,
  their addresses asked once (what :class:`mla.dispatch.BoundLaunch` calls);
- ``launches_bound``: the two bound launches, each asking its tensors' addresses;
- ``empty2``: the call's two allocations of out and lse (``torch.empty_like`` of the plan's
  stand-ins), and ``empty2_by_shape`` the same made by ``torch.empty`` from the shapes;
- ``flashmla``: FlashMLA's own call, where its extension imports;

beside the graph time and the Python per call with the launches stubbed
(:func:`mla.bench.host_cost`), and a cProfile of the full call at V4-TP8 b1. Writes
$OUT/eager_probe.json and $OUT/eager_profile.txt.

    OUT=out python experiments/eager_probe.py
"""
import argparse
import cProfile
import io
import json
import os
import pathlib
import pstats
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402

from mla import bench, dispatch  # noqa: E402
from mla.bench import Case  # noqa: E402

SHAPES = [("DSA", 1), ("V4-CSA", 1), ("V4-CSA", 32), ("V4-TP8", 1), ("V4-TP8", 32)]


def loop_us(fn, calls: int = 200, reps: int = 3) -> float:
    """Wall us per call of ``calls`` back-to-back ``fn()``, synchronized once at the end, median."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(times), 2)


def recorded_launches(plan, call):
    """[(BoundLaunch, kernel, args, addresses)] of one planned call (the addresses the Launcher
    passed: the decode's, which the combine's launch picks from)."""
    seen = []
    orig = dispatch.BoundLaunch.__call__

    def spy(self, kernel, args, addresses=None):
        seen.append((self, kernel, args, addresses))
        return orig(self, kernel, args, addresses)
    dispatch.BoundLaunch.__call__ = spy
    try:
        call()
    finally:
        dispatch.BoundLaunch.__call__ = orig
    return seen


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if mla.INTERPRET:
        sys.exit("eager_probe: needs a CUDA GPU")
    out_dir = pathlib.Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    shapes = {(s.name, s.b): s for s in bench.spec_shapes()}
    rows = []
    for key in SHAPES:
        s = shapes[key]
        case = Case(s, dev, pool_bytes=5e8)
        call = case.caller("mma")
        plan = call.plan
        n = len(case.index_sets)
        it = iter(range(10 ** 9))
        row = {"shape": s.name, "b": s.b, "launch": repr(plan), "us_graph": round(bench.time_graph(case, call), 2)}
        row["full"] = loop_us(lambda: call(next(it) % n))
        q, kc, idx, kw = case.q, case.cache, case.index_sets[0], case.kwargs(0)
        out = torch.empty_like(q)
        lse = torch.empty(s.b, s.h_q, s.s_q, device=dev)
        row["planned_out"] = loop_us(lambda: mla.sparse_decode(q, kc, idx, **kw, plan=plan, out=out, lse=lse))
        la = plan.launcher
        ws = plan.workspace
        ek, ei = kw.get("extra_k_cache"), kw.get("extra_indices")
        row["launcher"] = loop_us(lambda: la(q, kc, idx, case.sink, None, ek, ei, None, out, lse, *ws))
        launches = recorded_launches(plan, lambda: la(q, kc, idx, case.sink, None, ek, ei, None, out, lse, *ws))
        row["launches_n"] = len(launches)
        direct = [(b, dispatch._addresses(t) if a is None else a)
                  for b, _, t, a in launches if b._direct is not None]
        row["launches_direct_n"] = len(direct)
        stream = torch.cuda.current_stream().cuda_stream

        def launches_c():           # the compiled kernels' C launchers alone, addresses asked once
            for b, addresses in direct:
                b._direct(stream, addresses)
        row["launches_c"] = loop_us(launches_c)

        def launches_bound():       # the bound launches, the decode's addresses asked each call
            for b, kernel, t, a in launches:
                b(kernel, t, None if b._own_addresses else a)
        row["launches_bound"] = loop_us(launches_bound)
        row["empty2"] = loop_us(lambda: (torch.empty_like(plan.outputs[0]), torch.empty_like(plan.outputs[1])))
        row["empty2_by_shape"] = loop_us(lambda: (torch.empty(s.b, s.s_q, s.h_q, 512, dtype=torch.bfloat16, device=dev),
                                                  torch.empty(s.b, s.h_q, s.s_q, device=dev)))
        row.update({k: v for k, v in bench.host_cost(shapes=[s], calls=500, reps=3, device="cuda")[0].items()
                    if k.startswith("us ")})
        if bench.flash_mla is not None and s.h_q in (64, 128):
            fcall = case.caller("flashmla")
            it2 = iter(range(10 ** 9))
            row["flashmla_graph"] = round(bench.time_graph(case, fcall), 2)
            row["flashmla_full"] = loop_us(lambda: fcall(next(it2) % n))
        print(json.dumps(row), flush=True)
        rows.append(row)
        if key == ("V4-TP8", 1):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(500):
                call(next(it) % n)
            torch.cuda.synchronize()
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
            (out_dir / "eager_profile.txt").write_text(buf.getvalue())
        case = call = None
        torch.cuda.empty_cache()
    result = {"provenance": bench.provenance({}), "what": __doc__.split("\n\n")[0], "rows": rows}
    (out_dir / "eager_probe.json").write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out_dir / "eager_probe.json")


if __name__ == "__main__":
    main()
