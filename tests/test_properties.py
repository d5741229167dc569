"""Property-based tests (hypothesis): random small shapes, every impl against the float64
reference with the SPEC's tolerances; and tests of the validation harness itself.

On the CPU the kernels run in Triton's interpreter, so the shapes are tiny and the example
counts small; the runs are derandomized (the same examples every time, no example database)."""
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla
import mla.validate as mv
from mla.validate.cases import poison_unreferenced
from mla.validate.sweep import _clone_cache
from conftest import DEVICE
from experiments.broken_decodes import BROKEN, CORRECT_F32

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def small_specs(draw):
    """A tiny case: either layout (MODEL1 or V3.2), any h_q, P, topk, s_q, an extra cache with its
    own P, lengths, sinks with +-inf, invalid indices of every kind, a query with nothing valid, a
    peaked softmax."""
    h_q = draw(st.sampled_from([1, 2, 3, 5, 8, 17]))
    b = draw(st.integers(1, 2 if h_q <= 8 else 1))
    s_q = draw(st.integers(1, 3 if h_q <= 5 else (2 if h_q <= 8 else 1)))     # <= 24 (query, head) programs
    extra = draw(st.booleans())
    sink = draw(st.sampled_from(["inf", "finite", "none"]))
    return mv.CaseSpec(
        "hypothesis", b=b, s_q=s_q, h_q=h_q, topk=draw(st.integers(1, 40)), page=draw(st.integers(1, 20)),
        num_blocks=draw(st.sampled_from([None, 1, 3])),
        extra_topk=draw(st.integers(1, 24)) if extra else 0, extra_page=draw(st.integers(1, 9)),
        lengths=draw(st.booleans()), sink=sink != "none", sink_inf=sink == "inf",
        invalid_frac=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])), empty_query=draw(st.booleans()),
        softmax_scale=draw(st.sampled_from([None, 0.02, 0.3])), q_scale=draw(st.sampled_from([1.0, 6.0])),
        seed=draw(st.integers(0, 2 ** 16)), d_qk=draw(st.sampled_from([512, 576])))


# a +inf sink makes exp(sink - lse) overflow to inf on purpose (the factor is then 0); the
# interpreter evaluates it with numpy, which warns
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("impl", ["reference", "simt", "mma"])
def test_every_impl_matches_the_float64_reference_on_random_small_shapes(impl, device):
    fn = functools.partial(mla.sparse_decode, impl=impl)

    @settings(SETTINGS, max_examples=15 if impl == "simt" else 20)   # simt: one program per head
    @given(spec=small_specs())
    def prop(spec):
        row = mv.check(fn, spec, device, leak_check=False, name=impl)
        assert row["ok"], f"{spec}\n{row}"

    prop()


@SETTINGS
@given(spec=small_specs())
def test_the_result_does_not_depend_on_unreferenced_bytes(spec):
    """NaN in unreferenced bytes never reaches out, and zeros there give the same bits."""
    case = spec.make(DEVICE)
    out, lse = mla.sparse_decode(**case, impl="mma")
    assert not out.isnan().any() and not lse.isnan().any()
    assert mv.unreferenced_invariant(functools.partial(mla.sparse_decode, impl="mma"), case, out, lse)


# ---- the harness itself -------------------------------------------------------------------

def test_a_one_page_cache_without_its_padding_is_poisoned_and_cloned():
    """A one-page cache moved with ``.to(device)`` (here: cloned) keeps its padded page stride,
    but its storage ends after the tokens: the case maker's poisoning and the sweep's clone
    stay inside that storage (the one-page, one-block cases failed so on the GPU)."""
    cache = mla.quantize_kv(torch.randn(1, 1, 512).bfloat16()).clone()
    assert cache.stride(0) == 1152 and cache.untyped_storage().nbytes() == 584
    before = cache.view(torch.uint8).flatten().clone()
    poison_unreferenced(cache, torch.tensor([[[-1]]]))
    poisoned = cache.view(torch.uint8).flatten()
    assert (poisoned[:448] == 0x7F).all() and (poisoned[448:576] == 0xFF).all() and not torch.equal(poisoned, before)
    copy = _clone_cache(cache)
    assert copy.stride() == cache.stride() and torch.equal(copy.view(torch.uint8), cache.view(torch.uint8))


def test_a_v32_cache_is_poisoned_part_by_part():
    """V3.2's tokens lie together: an unreferenced token's nope bytes become 0x7F (e4m3 NaN), its
    float32 scales and its bf16 rope 0xFF (NaN), the page's spare token (its stride padding)
    0x7F; a referenced token keeps its bytes."""
    cache = mla.quantize_kv(torch.randn(2, 2, 576).bfloat16())          # page stride (2+1)*656 = 1968
    raw = torch.as_strided(cache.view(torch.uint8), (2 * 1968,), (1,))
    kept = raw[1968 + 656: 1968 + 1312].clone()                          # token 3: block 1, offset 1
    poison_unreferenced(cache, torch.tensor([[[3, -1, 4]]]))
    for at in (0, 656, 1968):                                            # tokens 0, 1, 2
        assert (raw[at: at + 512] == 0x7F).all() and (raw[at + 512: at + 656] == 0xFF).all()
    assert torch.equal(raw[1968 + 656: 1968 + 1312], kept)
    assert (raw[1312:1968] == 0x7F).all() and (raw[1968 + 1312:] == 0x7F).all()
    assert bool(mla.dequantize_kv(cache)[0].isnan().all(-1).all())


def test_every_broken_variant_is_caught_and_the_correct_one_passes():
    df = mv.sweep(dict(BROKEN, correct=CORRECT_F32), mv.quick_cases(), "cpu", progress=False)
    per = df.groupby("impl")["ok"].all()
    assert per["correct"], mv.table(df[df.impl == "correct"])
    for name in BROKEN:
        assert not per[name], f"{name} was not caught"


def test_a_nan_leak_is_caught():
    """A decode that reads every index's bytes (clamped into range) and only then masks, with a
    multiply by 0, turns the poisoned bytes into NaN: caught as a NaN and as a failure."""
    spec = mv.CaseSpec("leak", b=1, s_q=1, h_q=2, topk=24, page=8, invalid_frac=0.3, seed=3)
    row = mv.check(BROKEN["masks scores, not V (0*NaN)"], spec, "cpu")
    assert not row["ok"] and row["nan_count"] > 0


def test_reading_an_unreferenced_token_is_caught_even_without_nan():
    """A decode that replaces NaN by 0 after the fact hides the NaN; the second call, with
    zeros in the unreferenced bytes instead, still gives different bits for an output in
    which an unreferenced token took part."""
    def sneaky(**kw):
        out, lse = BROKEN["no mask (clamps invalid indices)"](**kw)
        return torch.nan_to_num(out, nan=0.0), torch.nan_to_num(lse, nan=0.0)

    spec = mv.CaseSpec("sneaky", b=1, s_q=1, h_q=2, topk=16, page=8, num_blocks=8, invalid_frac=0.5, sink=False,
                       seed=5)
    row = mv.check(sneaky, spec, "cpu")
    assert row["nan_count"] == 0
    assert row["leak_ok"] is False and not row["ok"]


def test_a_crash_is_a_failed_row_not_an_exception():
    def crashes(**kw):
        raise RuntimeError("boom")

    row = mv.check(crashes, mv.quick_cases()[0], "cpu")
    assert not row["ok"] and row["crashed"] and "boom" in row["error"]


def test_wrong_dtype_and_shape_fail():
    def f32(**kw):
        out, lse = mla.sparse_decode(**kw, impl="reference")
        return out.float(), lse

    def transposed(**kw):
        out, lse = mla.sparse_decode(**kw, impl="reference")
        return out, lse.transpose(1, 2)

    spec = mv.CaseSpec("shape", b=2, s_q=2, h_q=3, topk=8, page=4)
    assert not mv.check(f32, spec, "cpu")["ok"]
    assert not mv.check(transposed, spec, "cpu")["ok"]


def test_sweep_has_a_row_per_case_and_impl_and_a_summary():
    cs = mv.quick_cases()[:3]
    impls = ["reference", CORRECT_F32, BROKEN["lse includes the sink"]]
    df = mv.sweep(impls, cs, "cpu", progress=False, leak_check=False)
    assert len(df) == len(cs) * len(impls)
    assert set(df["case"]) == {c.name for c in cs}
    s = mv.summary(df)
    assert s["cases"] == 3 and s["rows"] == 9 and s["failures"] >= 1
    text = mv.table(df, width=300)
    assert "FAIL" in text and all(c.name in text for c in cs)


def test_validate_in_three_lines():
    report = mv.validate(functools.partial(mla.sparse_decode, impl="reference"), mv.quick_cases()[:2],
                         progress=False)
    assert report.ok, report
    assert "PASS" in str(report)


def test_compare_reports_the_worst_element_and_where():
    ref = torch.zeros(2, 3, 4, dtype=torch.float64)
    got = ref.clone()
    got[1, 2, 3] = 0.01           # 10x the absolute allowance, relative error infinite
    got[0, 1, 1] = 0.0005         # inside the allowance
    c = mv.compare("out", got, ref, mv.OUT_ABS, mv.OUT_REL)
    assert not c.ok and c.n_bad == 1 and c.worst_index == (1, 2, 3)
    assert abs(c.worst_excess - 10) < 1e-9
    inf = ref.clone()
    inf[0, 0, 0] = float("inf")
    c = mv.compare("lse", ref, inf, mv.LSE_ABS, mv.LSE_REL)
    assert not c.ok and c.special_mismatch == 1 and c.worst_index == (0, 0, 0)


def test_case_sets():
    odd = mv.odd_cases()
    assert 25 <= len(odd) <= 45
    for axis, values in mv.ODD_AXES.items():
        if axis in ("h_q", "page", "topk", "s_q", "lengths"):
            assert {getattr(c, axis) for c in odd} >= set(values), axis
    bench = mv.benchmark_cases(pool_bytes=1e8)
    assert len(bench) == 12 and all(c.num_blocks * c.page * 584 <= 1.01e8 for c in bench)
    v32 = mv.v32_cases(pool_bytes=1e8)
    assert len(v32) == 10 and {c.d_qk for c in v32} == {576} and {c.h_q for c in v32} == {64, 128}
    assert {(c.topk, c.page) for c in v32} == {(2048, 64)} and {c.s_q for c in v32} == {1, 2}
    assert min(c.b for c in v32) == 1 and max(c.b for c in v32) == 64
    assert all(c.num_blocks * 65 * 656 <= 1.01e8 for c in v32)          # pages of (64+1)*656 bytes
    grid = mv.cases({"h_q": [1, 64], "page": [7, 64]}, topk=40)
    assert len(grid) == 4 and {(c.h_q, c.page) for c in grid} == {(1, 7), (1, 64), (64, 7), (64, 64)}
