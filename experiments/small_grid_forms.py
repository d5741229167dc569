"""Dev tool (GPU): where the launch rule's small-grid threshold (:func:`mla.dispatch.small_grid`)
switches the Gluon kernel from heads as M to tokens as M, is it at the right place? At the
sweep's configs, 64 and 128 heads, and the few-query grids around the threshold, each point's
CUDA-graph time in both forms (forced with ``mla.plan(config=...)``, the programs the rule gives
that form), beside FlashMLA's in the same run.

    python experiments/small_grid_forms.py OUT.json [--budget-s S]
"""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402, F401  (first: it may turn Triton's interpreter on)

from experiments import probe_main  # noqa: E402
from mla import bench  # noqa: E402
from mla.configs import GluonConfig  # noqa: E402

FORMS = ("heads as M", "tokens as M, 16 x 64")
GRIDS = ((1, 2), (2, 1), (2, 2), (8, 1), (8, 2), (32, 1))      # (b, s_q)


def shapes():
    return [bench.Shape(f"sweep {name}", b, s_q, h_q, **cfg) for h_q in (64, 128)
            for name, cfg in bench.SWEEP_CONFIGS.items() for b, s_q in GRIDS]


def main(argv=None):
    probe_main(argv, __doc__, "small_grid_forms", shapes, measure, budget_s=150)


def measure(case) -> dict:
    s = case.shape
    row = {"shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "rule": case.caller("mma").plan.launch.config.label}
    if bench.flash_mla is not None:
        row["us_flashmla"] = round(bench.time_graph(case, case.caller("flashmla")), 2)
    for form in FORMS:
        call = case.caller("mma", config=GluonConfig(form))
        row[form] = {"programs": call.plan.launch.programs, "us": round(bench.time_graph(case, call), 2)}
    return row


if __name__ == "__main__":
    main()
