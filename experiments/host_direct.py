"""Dev probe (CPU, no GPU): the Python of a planned call as a GPU host runs it, at several commits.

On a GPU a plan's launches go straight into each compiled kernel's C launcher
(:class:`mla.dispatch.BoundLaunch`); on a CPU-only machine ``python -m mla.bench --host`` takes
Triton's path instead, since its tensors are not on a CUDA device. This runs the record's V4
and DSA shapes with the launch rule planning as on an H200 (:func:`mla.bench._stubbed_launches`:
kernels that do nothing, a C launcher that does nothing) and each plan's launches told they are
on device 0 with a stand-in stream, so that the calls take the direct path a GPU host takes.
Each commit is checked out in a temporary git worktree and timed in its own process; the loops
are ``timeit``'s, the fastest of 9 rounds, with ``out=`` and ``lse=`` given and without.

    python experiments/host_direct.py OUT.json COMMIT [COMMIT ...]
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPES = [("DSA", 1), ("DSA", 32), ("V4-CSA", 1), ("V4-CSA", 32), ("V4-TP8", 1), ("V4-TP8", 128)]

#: run in the checked-out commit's tree: one JSON row per shape on stdout
HARNESS = r"""
import json, sys, timeit
import torch
from mla import api, bench, quantize_kv
from mla.layout import D_QK
torch._C._cuda_getCurrentRawStream = lambda device: 0          # the stand-in stream
shapes = {(s.name, s.b): s for s in bench.spec_shapes()}
def best(f, n=20000):
    return min(timeit.repeat(f, number=n, repeat=9)) / n * 1e6
with bench._stubbed_launches(True):
    for name, b in json.loads(sys.argv[1]):
        s = shapes[(name, b)]
        q = torch.zeros(s.b, s.s_q, s.h_q, D_QK, dtype=torch.bfloat16)
        kw = dict(attn_sink=torch.zeros(s.h_q))
        cache = quantize_kv(torch.zeros(1, s.page, D_QK, dtype=torch.bfloat16))
        idx = torch.zeros(s.b, s.s_q, s.topk, dtype=torch.int32)
        if s.extra_topk:
            kw.update(extra_k_cache=quantize_kv(torch.zeros(1, s.extra_page, D_QK, dtype=torch.bfloat16)),
                      extra_indices=torch.zeros(s.b, s.s_q, s.extra_topk, dtype=torch.int32))
        out, lse = torch.empty_like(q), torch.empty(s.b, s.h_q, s.s_q)
        plan = api.plan(q, cache, idx, **kw, impl="mma")
        plan.launcher._decode._device = plan.launcher._combine._device = 0     # as on device 0
        api.sparse_decode(q, cache, idx, **kw, plan=plan, out=out, lse=lse)   # the first call: Triton's path
        direct = [getattr(bl, "_direct", getattr(bl, "_fast", None)) is not None
                  for bl in (plan.launcher._decode, plan.launcher._combine) if bl._compiled is not None]
        print(json.dumps({"shape": name, "b": b, "launch": plan.launch.label, "direct_launches": sum(direct),
                          "us with out": round(best(lambda: api.sparse_decode(q, cache, idx, **kw, plan=plan,
                                                                               out=out, lse=lse)), 2),
                          "us without out": round(best(lambda: api.sparse_decode(q, cache, idx, **kw,
                                                                                  plan=plan)), 2)}), flush=True)
"""


def at_commit(commit: str) -> list:
    """The harness's rows with the package of ``commit``."""
    with tempfile.TemporaryDirectory() as d:
        tree = pathlib.Path(d) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree), "TRITON_INTERPRET": "1"}
            r = subprocess.run([sys.executable, "-c", HARNESS, json.dumps(SHAPES)], cwd=tree, env=env,
                               capture_output=True, text=True, check=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return [{"commit": commit, **json.loads(line)} for line in r.stdout.splitlines() if line.startswith("{")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("commits", nargs="+")
    a = ap.parse_args(argv)
    rows = [row for c in a.commits for row in at_commit(c)]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    doc = {"provenance": {"commit": head, "date": now, "cpu": cpu, "cpus": os.cpu_count(),
                          "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                          "note": "CPU only; the launches stubbed, the direct path taken as on a GPU host"},
           "commits": a.commits, "rows": rows}
    pathlib.Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    for row in rows:
        print(row)


if __name__ == "__main__":
    sys.exit(main())
