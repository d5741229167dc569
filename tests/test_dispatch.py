"""The launch rule (mla.dispatch) picks what the code before the layered package picked: the same
kernel, form and config over a grid of 2880 (GPU, SMs, b, s_q, h_q, topk, extra topk,
alignment) cases, held to the table that tests/fixtures/make_launch_choices.py wrote from that
code (38a926e); the split count too for the one form that still splits each query uniformly (two
consumers). Every other form now runs the flat work list (tests/test_schedule.py). Off sm_90
the generic tables were since derived from each architecture's registers
(:func:`mla.configs.generic`): there the pick keeps the fixture's kernel and tile, and its head
block is the rule's. Nothing here needs a GPU."""
import collections
import json
import pathlib

import pytest
import torch

from mla import configs, dispatch, layout
from mla.configs import GLUON_FORMS

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "launch_choices.json"


def _rows():
    data = json.loads(FIXTURE.read_text())
    cc, ch = data["case_columns"], data["choice_columns"]
    return [(dict(zip(cc, r[:len(cc)])), {k: v for k, v in zip(ch, r[len(cc):]) if v is not None})
            for r in data["rows"]]


#: the old code's names of the Gluon forms (the fixture's), and today's
OLD_FORMS = {"heads as M": "heads as M", "tokens as M 16x64": "tokens as M, 16 x 64",
             "tokens as M 8x128": "tokens as M, 8 x 128", "tokens as M two consumers": "tokens as M, two consumers"}


def _choice(cfg, programs, want) -> dict:
    """The fixture's columns for a pick; the split count only where the form still splits each
    query uniformly (its ``programs``), the fixture's own elsewhere."""
    if cfg.kernel == "gluon":
        old = {v: k for k, v in OLD_FORMS.items()}[cfg.form]
        return {"kernel": "gluon", "form": old, "block_h": cfg.block_h, "block_n": cfg.block_n,
                "splits": programs if cfg.two_consumers else want["splits"]}
    return {"kernel": "tl_dot", "block_h": cfg.block_h, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "dv_halves": cfg.dv_halves, "splits": want["splits"]}


def test_the_fixture_covers_enough_cases_and_every_kernel_and_form():
    rows = _rows()
    assert len(rows) >= 500
    forms = {c.get("form") for _, c in rows if c["kernel"] == "gluon"}
    assert forms == set(OLD_FORMS) and set(OLD_FORMS.values()) == set(GLUON_FORMS)
    assert {c.get("dv_halves") for _, c in rows if c["kernel"] == "tl_dot"} == {1, 2}
    assert len({(r["gpu"], r["sms"]) for r, _ in rows}) >= 6 and {r["aligned"] for r, _ in rows} == {True, False}


def test_the_launch_rule_picks_what_it_picked_before():
    wrong = []
    for case, want in _rows():
        table = configs.table_for(case["gpu"], "3.6", case["arch"])[1]
        gluon = dispatch.gluon_sm90 is not None and configs.gluon_for(case["gpu"], "3.6", case["arch"])
        cfg, programs, _share = dispatch.decide(table, gluon, case["sms"], case["b"], case["s_q"], case["h_q"],
                                                case["topk"], case["extra_topk"], 16 if case["aligned"] else 0)
        got = _choice(cfg, programs, want)
        if want["kernel"] == "tl_dot" and want["dv_halves"] == 2 and case["arch"] == 90:
            want = {**want, "num_warps": 8}     # the small-grid form at 8 warps since v34 (fill_small_grid)
        elif want["kernel"] == "tl_dot" and case["gpu"] == "NVIDIA H200" and want["block_h"] == 64:
            want = {**want, "num_stages": 1}    # the H200 table's 64-head configs at one stage since v35
        if case["arch"] in configs.ACCUMULATOR_REGS and want["kernel"] == "tl_dot":   # the derived table
            same = got["kernel"] == "tl_dot" and got["block_n"] == want["block_n"] \
                and configs.accumulator_regs(cfg) <= configs.ACCUMULATOR_REGS[case["arch"]] \
                and cfg.block_h <= max(want["block_h"], configs.MIN_BLOCK_H)
            if not same:
                wrong.append((case, want, got))
        elif got != want:
            wrong.append((case, want, got))
    assert not wrong, f"{len(wrong)} cases differ, e.g. {wrong[:3]}"


@pytest.mark.parametrize("b,s_q,h_q,total,block_h,block_n,dv,sms", [
    (1, 1, 64, 2048, 64, 64, 1, 132), (128, 1, 8, 640, 8, 128, 1, 132), (3, 2, 20, 77, 32, 64, 2, 108),
    (256, 1, 128, 2048, 64, 64, 1, 170), (1, 1, 1, 1, 16, 16, 1, 4)])
def test_num_splits_is_plain_integer_arithmetic(b, s_q, h_q, total, block_h, block_n, dv, sms):
    """The split count, recomputed here from its cost model with exact fractions: the cheapest
    split, the fewest on a tie."""
    import math
    from fractions import Fraction

    progs = b * s_q * math.ceil(h_q / block_h) * dv
    tiles = max(1, math.ceil(total / block_n))
    costs = {s: math.ceil(progs * s / sms) * math.ceil(tiles / s) + (Fraction(1, 2) if s > 1 else 0)
             + Fraction(s, 100) for s in range(1, tiles + 1)}
    want = min(costs, key=lambda s: (costs[s], s))
    assert dispatch.num_splits(b, s_q, h_q, total, block_h, block_n, dv, sms) == want


def test_v32_calls_run_gluon_heads_as_m_where_model1_calls_do_and_tl_dot_elsewhere():
    """The Gluon kernel reads V3.2's cache in the heads-as-M form only (dispatch.GLUON_LAYOUTS):
    on every case of the fixture, on a Hopper GPU that runs Gluon, a V3.2 call whose MODEL1 twin
    runs heads as M runs it too, on the same schedule; any other V3.2 call gets exactly the pick
    of a GPU without Gluon (the tl.dot kernel, its config and form, and its schedule). A V3.2
    cache as mla and FlashMLA allocate it ((P + 1) * 656 bytes a page) is copied 16 bytes at a
    time."""
    from mla.layout import V32

    assert set(dispatch.GLUON_LAYOUTS) == {layout.MODEL1, V32}
    assert dispatch.GLUON_LAYOUTS[V32] == ("heads as M",) and dispatch.PORTABLE_LAYOUTS == (layout.MODEL1,)
    picked = collections.Counter()
    for case, _want in _rows():
        table = configs.table_for(case["gpu"], "3.6", case["arch"])[1]
        args = (case["sms"], case["b"], case["s_q"], case["h_q"], case["topk"], case["extra_topk"],
                16 if case["aligned"] else 0)
        model1 = dispatch.decide(table, True, *args)
        v32 = dispatch.decide(table, True, *args, layout=V32)
        if model1[0] == configs.GluonConfig("heads as M"):
            assert v32 == model1, case
        else:
            assert v32 == dispatch.decide(table, False, *args), case
            assert v32[0].kernel == "tl_dot", case
        picked[v32[0].kernel, model1[0].kernel] += 1
    assert picked["gluon", "gluon"] > 50 and picked["tl_dot", "gluon"] > 50     # both kinds of case are many
    cache = layout.quantize_kv(torch.zeros(2, 64, 576, dtype=torch.bfloat16))
    assert cache.stride(0) == 65 * 656
    assert dispatch.gluon_align(cache) == 16 and dispatch.gluon_align(cache, cache) == 16


def test_a_forced_gluon_config_is_refused_for_v32_by_name():
    from mla.layout import V32

    with pytest.raises(ValueError, match=r"^config: the Gluon kernel reads V3.2's cache in the forms \['heads as M'\] "
                                         r"only, not 'tokens as M, 16 x 64'"):
        dispatch.plan_launch(torch.device("cpu"), 1, 1, 16, 2048, 0, 16,
                             config=configs.GluonConfig("tokens as M, 16 x 64"), layout=V32)
    # the form it has passes that check and meets the device's: the interpreter runs no Gluon
    with pytest.raises(ValueError, match="^config: the Gluon kernel is for Hopper GPUs"):
        dispatch.plan_launch(torch.device("cpu"), 1, 1, 64, 2048, 0, 16, config=configs.GluonConfig(), layout=V32)
    with pytest.raises(ValueError, match="^config: the portable Gluon kernel reads the MODEL1 cache only"):
        dispatch.plan_launch(torch.device("cpu"), 1, 1, 64, 2048, 0, 16, config=configs.PortableConfig(),
                             layout=V32)


def test_a_forced_cluster_form_is_refused_where_it_cannot_run_by_name():
    """The 2-CTA cluster form reads MODEL1's cache only, on sm_90 with a Triton that builds it."""
    from mla.layout import V32

    with pytest.raises(ValueError, match="^config: the cluster form reads the MODEL1 cache only, not V3.2's"):
        dispatch.plan_launch(torch.device("cpu"), 1, 1, 128, 2048, 0, 16, config=configs.ClusterConfig(), layout=V32)
    built = dispatch.gluon_cluster is not None
    with pytest.raises(ValueError, match="^config: the cluster form is for Hopper GPUs" if built
                       else "^config: the cluster form needs Triton 3.9"):
        dispatch.plan_launch(torch.device("cpu"), 1, 1, 128, 2048, 0, 16, config=configs.ClusterConfig())


def test_a_cluster_takes_two_sms_in_the_schedule():
    """A 128-head cluster occupies 2 SMs: on 132 SMs it gets 66 persistent programs, the SMs that
    the two-program form's two 64-head blocks of 66 programs take."""
    cluster = dispatch.programs_for(configs.ClusterConfig(), 4096, 128, 2048, 0, 132, True)
    pair = dispatch.programs_for(configs.GluonConfig(), 4096, 128, 2048, 0, 132, True)
    assert cluster == (66, 0) and pair == (66, 0)
    assert dispatch.programs_for(configs.ClusterConfig(), 4096, 128, 2048, 0, 133, True) == (66, 0)
