"""Run FlashMLA's own test files against ``mla``, unchanged, from a FlashMLA checkout.

    python scripts/flashmla_tests.py FLASHMLA_DIR --suite prefill|decode [--small] [--out FILE.json]

FLASHMLA_DIR is a checkout of deepseek-ai/FlashMLA (or a tree exported from one with
``git archive``): its ``tests/`` folder is all this reads. Nothing of FlashMLA is built, and
nothing of it is copied here. A stand-in package ``flash_mla``, whose ``flash_mla_with_kvcache``,
``get_mla_metadata`` and ``flash_mla_sparse_fwd`` are ``mla.flash_mla``'s, goes first on
``sys.path``; then FlashMLA's ``tests/lib.py``, ``ref.py``, ``quant.py``, ``kernelkit`` and the
suite's test module (``test_flash_mla_sparse_prefill.py`` or ``test_flash_mla_sparse_decoding.py``)
are imported as they are, and each case runs through the module's own runner (``run_test`` /
``test_flash_mla``): its generator, its reference and its checks (kernelkit's
``check_is_allclose`` with its tolerances). The case lists are the test files' own: the decode's
``gen_testcase()``, and the prefill's lists in its ``__main__`` block, whose assignments are run
(and only those: not its device set-up or its loop).

Around them, this sets up what FlashMLA's ``__main__`` does (default dtype bf16, the default
device, float32 matmul precision "high") and, with no CUDA GPU, makes the CUDA-only calls the
tests make harmless: ``torch.cuda.synchronize`` does nothing and ``Tensor.cuda()`` stays on the
CPU. Every case runs with ``num_runs = 0``: this checks correctness; timing is ``mla.bench``'s.

``--small`` keeps the cases small enough for Triton's CPU interpreter (their work, in query rows x
heads x top-k positions, under a bound per suite); without it every case runs (a GPU's job). A
case whose call ``mla`` refuses with its ValueError (the decode's V3.2 cases, d_qk 576, while
``mla``'s decode serves the MODEL1 cache only) is reported as refused, apart from the failures.
``--out`` writes a summary: the cases run, passed, failed (with their parameters and the test's
output) and refused (with the reason), the FlashMLA commit, mla's commit and the device. The exit
status is 1 when a case failed.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime
import io
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402  (first: it may turn Triton's interpreter on before FlashMLA's kernelkit imports Triton)
import mla.flash_mla  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from mla import bench  # noqa: E402

#: each suite's test module and the function that runs one of its cases
SUITES = {"prefill": ("test_flash_mla_sparse_prefill", "run_test"),
          "decode": ("test_flash_mla_sparse_decoding", "test_flash_mla")}
#: --small: the most work a case may have, in query rows x heads x top-k positions (all caches):
#: the prefill's 62-token cases up to 128 heads and top-k 128 (its feature cases among them), the
#: decode's batch-4 cases up to 64 heads x 3 tokens x 128 positions: each suite's run takes
#: minutes on 2 cores
SMALL_WORK = {"prefill": 62 * 128 * 128, "decode": 4 * 3 * 64 * 128}

#: the stand-in package: FlashMLA's three entry points, as mla gives them
STAND_IN = '''"""A stand-in for FlashMLA's package, written by mla's scripts/flashmla_tests.py: its entry
points are mla.flash_mla's."""
from mla.flash_mla import FlashMLASchedMeta, flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
'''


def install_stand_in(folder: pathlib.Path) -> None:
    """Write the stand-in ``flash_mla`` package into ``folder`` and put it first on sys.path."""
    pkg = folder / "flash_mla"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(STAND_IN)
    sys.modules.pop("flash_mla", None)
    sys.path.insert(0, str(folder))


def set_up_device() -> torch.device:
    """What FlashMLA's ``__main__`` blocks set, on the GPU if there is one, else on the CPU with
    the CUDA-only calls of its tests made harmless there."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(device)
    torch.set_float32_matmul_precision("high")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    return device


def main_block_assignments(path: pathlib.Path) -> list[ast.stmt]:
    """The assignments of a test file's ``if __name__ == '__main__':`` block, in order (its case
    lists), without its calls and loops."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            return [s for s in node.body if isinstance(s, ast.Assign)]
    return []


def load_cases(suite: str, module, tests_dir: pathlib.Path) -> list:
    """The suite's cases, as its test file lists them (TestParam objects)."""
    if suite == "decode":
        return [raw.to_test_param() for raw in module.gen_testcase()]
    namespace = vars(module)
    for stmt in main_block_assignments(tests_dir / f"{SUITES[suite][0]}.py"):
        exec(compile(ast.Module([stmt], []), str(tests_dir / f"{SUITES[suite][0]}.py"), "exec"), namespace)
    return list(namespace["testcases"])


def work(p) -> int:
    """Query rows x heads x top-k positions of a case (the decode's batch and extra cache counted)."""
    if p.decode is None:
        return p.s_q * p.h_q * p.topk
    return p.decode.b * p.s_q * p.h_q * (p.topk + (p.decode.extra_topk or 0))


def describe(p) -> dict:
    return dataclasses.asdict(p)


def refused_by_mla(exc: BaseException) -> bool:
    """Whether ``exc`` is mla's own ValueError for an argument it does not take (raised by
    :func:`mla.layout.fail`)."""
    if not isinstance(exc, ValueError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].name == "fail" and frames[-1].filename.endswith(os.path.join("mla", "layout.py"))


def run_case(runner, p) -> tuple[str, str]:
    """(outcome: "passed", "failed" or "refused", the test's output or the reason)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            result = runner(p)
    except Exception as e:  # noqa: BLE001
        if refused_by_mla(e):
            return "refused", str(e)
        return "failed", buf.getvalue()[-3000:] + "".join(traceback.format_exception(e))[-3000:]
    ok = result if isinstance(result, bool) else bool(result.is_correct)
    return ("passed" if ok else "failed"), ("" if ok else buf.getvalue()[-3000:])


def flashmla_commit(folder: pathlib.Path, given: str | None) -> str:
    if given:
        return given
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except OSError:
        pass
    return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), Triton's interpreter"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("flashmla", type=pathlib.Path, help="a FlashMLA checkout (its tests/ folder is read)")
    ap.add_argument("--suite", choices=sorted(SUITES), required=True)
    ap.add_argument("--small", action="store_true",
                    help="only the cases small enough for the CPU interpreter (work under "
                         + ", ".join(f"{k} {v}" for k, v in SMALL_WORK.items()) + ")")
    ap.add_argument("--max-work", type=int, help="with --small, this bound on a case's work instead")
    ap.add_argument("--limit", type=int, help="run only the first this many of the chosen cases")
    ap.add_argument("--d-qk", type=int, choices=(512, 576), dest="d_qk",
                    help="only the cases of this head dim (576: DeepSeek-V3.2's cache)")
    ap.add_argument("--out", type=pathlib.Path, help="write the summary here (JSON)")
    ap.add_argument("--flashmla-commit", help="the checkout's commit, where it has no git metadata (git archive)")
    a = ap.parse_args(argv)
    tests_dir = a.flashmla / "tests"
    module_name, runner_name = SUITES[a.suite]
    if not (tests_dir / f"{module_name}.py").exists():
        ap.error(f"{tests_dir / (module_name + '.py')} not found: FLASHMLA_DIR must be a FlashMLA checkout")
    t0, mla_commit = time.time(), bench.code_commit(ROOT)
    with tempfile.TemporaryDirectory() as stand_in:
        install_stand_in(pathlib.Path(stand_in))
        sys.path.insert(1, str(tests_dir))
        device = set_up_device()
        module = __import__(module_name)
        runner = getattr(module, runner_name)
        cases = load_cases(a.suite, module, tests_dir)
        bound = a.max_work or SMALL_WORK[a.suite]
        chosen = [p for p in cases if (not a.small or work(p) <= bound)
                  and (a.d_qk is None or p.d_qk == a.d_qk)][:a.limit]
        outcomes = {"passed": [], "failed": [], "refused": []}
        for i, p in enumerate(chosen):
            p.num_runs = 0
            outcome, text = run_case(runner, p)
            entry = {"params": describe(p)}
            if outcome == "failed":
                entry["output"] = text
            elif outcome == "refused":
                entry["reason"] = text
            outcomes[outcome].append(entry)
            print(f"[{i + 1}/{len(chosen)}] {outcome}: {p}", flush=True)
            if a.out and (i + 1) % 20 == 0:      # a run cut short keeps what it checked
                _write(a.out, _summary(a, cases, chosen, outcomes, i + 1, t0, mla_commit, device, module_name, bound))
    summary = _summary(a, cases, chosen, outcomes, len(chosen), t0, mla_commit, device, module_name, bound)
    n = {k: summary[k] for k in outcomes}
    print(f"{a.suite}: {n['passed']} passed, {n['failed']} failed, {n['refused']} refused by mla, of {len(chosen)} "
          f"run ({len(cases)} listed), {summary['seconds']} s")
    if a.out:
        _write(a.out, summary)
        print(f"wrote {a.out}")
    return 1 if n["failed"] else 0


def _write(path, summary):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")


def _summary(a, cases, chosen, outcomes, done, t0, mla_commit, device, module_name, bound) -> dict:
    """The run's summary after ``done`` of the ``chosen`` cases (``complete`` once all ran)."""
    n = {k: len(v) for k, v in outcomes.items()}
    return {
        "suite": a.suite, "mode": "small" if a.small else "all",
        "flashmla": {"path": str(a.flashmla), "commit": flashmla_commit(a.flashmla, a.flashmla_commit),
                     "test_file": f"tests/{module_name}.py"},
        "mla_commit": mla_commit, "device": device_name(device),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "seconds": round(time.time() - t0, 1),
        "cases_listed": len(cases), "cases_chosen": len(chosen), "cases_run": done, "complete": done == len(chosen),
        **n, "small_work_bound": bound if a.small else None, "limit": a.limit, "d_qk": a.d_qk,
        "refused_reasons": sorted({e["reason"] for e in outcomes["refused"]}),
        "failed_cases": outcomes["failed"], "refused_cases": [e["params"] for e in outcomes["refused"]],
    }


if __name__ == "__main__":
    sys.exit(main())
