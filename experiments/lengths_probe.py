"""Dev tool (GPU): with ``topk_length`` the kernels cut the work list on the device, balanced
over as many programs as the GPU runs at once (:func:`mla.dispatch.programs_for`). This probe
asks whether fewer programs would be faster there: at the sweep's configs with lengths (HCA-like
and long), each point's CUDA-graph time with the programs forced (``mla.plan(programs=...)``) to
the slots, 3/4, 1/2, 1/4 and 1/8 of them, beside FlashMLA's in the same run, with the units the
lengths actually give (summed on the host here, for the rule a result may suggest).

    python experiments/lengths_probe.py OUT.json [--budget-s S]
"""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402, F401  (first: it may turn Triton's interpreter on)

from experiments import probe_main  # noqa: E402
from mla import bench, dispatch, schedule  # noqa: E402

FRACTIONS = (1, 0.75, 0.5, 0.25, 0.125)


def shapes():
    out = []
    for h_q in (64, 128):
        for s_q in (1, 2):
            for name in ("HCA", "long"):
                cfg = bench.SWEEP_CONFIGS[name]
                out += [bench.Shape(f"sweep {name}", b, s_q, h_q, **cfg) for b in (2, 8, 32, 74, 148, 256)
                        if name != "long" or b <= bench.SWEEP_LONG_MAX_B]
    return out


def actual_units(case, cfg) -> list[int]:
    """Each query row's units under the lengths of ``case`` (every row of a batch entry alike)."""
    s = case.shape
    block_n, unit = ((dispatch.GLUON_RING_N, cfg.block_n // dispatch.GLUON_RING_N) if cfg.kernel == "gluon"
                     else (cfg.block_n, 1))
    n1 = case.lengths.tolist() if case.lengths is not None else [s.topk] * s.b
    n2 = case.extra_lengths.tolist() if case.extra_lengths is not None else [s.extra_topk] * s.b
    return [schedule.query_units(a, e, block_n, unit)[1] for a, e in zip(n1, n2) for _ in range(s.s_q)]


def main(argv=None):
    probe_main(argv, __doc__, "lengths_probe", shapes, measure, budget_s=200)


def measure(case) -> dict:
    s = case.shape
    chosen = case.caller("mma").plan.launch
    units = actual_units(case, chosen.config)
    row = {"shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "form": chosen.config.label,
           "chosen_programs": chosen.programs, "units_total": sum(units), "units_max": max(units)}
    if bench.flash_mla is not None:
        row["us_flashmla"] = round(bench.time_graph(case, case.caller("flashmla")), 2)
    row["us_by_programs"] = {}
    for f in FRACTIONS:
        n = max(1, round(chosen.programs * f))
        if str(n) not in row["us_by_programs"]:
            row["us_by_programs"][str(n)] = round(bench.time_graph(case, case.caller("mma", programs=n)), 2)
    return row


if __name__ == "__main__":
    main()
