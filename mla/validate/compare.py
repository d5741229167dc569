"""FlashMLA's whole check of a decode's (and a sparse prefill's) outputs against the float64
reference: elementwise tolerances, the inf/nan positions, and the cosine difference."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: out: |err| < 1e-3 or rel < 2.01/128; lse: |err| < 1e-6 or rel < 8.01/65536 (FlashMLA's own).
OUT_ABS, OUT_REL = 1e-3, 2.01 / 128
LSE_ABS, LSE_REL = 1e-6, 8.01 / 65536
#: FlashMLA's cosine-difference bounds (its decode test's check_is_allclose): out 5e-6, lse 1e-7.
OUT_COS, LSE_COS = 5e-6, 1e-7
#: The sparse prefill's (FlashMLA's tests/test_flash_mla_sparse_prefill.py): out |err| < 8e-4 or
#: rel < 3.01/128 and cosine difference 7e-6; max_logits and lse |err| < 1e-6 or rel < 2.01/65536,
#: with kernelkit's default cosine bound of 1e-7.
PREFILL_OUT_ABS, PREFILL_OUT_REL, PREFILL_OUT_COS = 8e-4, 3.01 / 128, 7e-6
PREFILL_STAT_ABS, PREFILL_STAT_REL, PREFILL_STAT_COS = 1e-6, 2.01 / 65536, 1e-7


@dataclass
class Closeness:
    """Result of comparing one tensor with its reference.

    ``worst_abs``/``worst_rel`` are the largest absolute and relative errors over all finite
    elements (the relative one is large wherever the reference is near 0, where the absolute
    allowance applies). ``worst_rel_past_abs`` is the largest relative error among the elements
    whose absolute error is past ``abs_tol``: the tensor passes iff it is below ``rel_tol``.
    ``worst_excess`` is, for the worst element, ``min(|err|/abs_tol, rel/rel_tol)`` (an element
    passes when it is < 1; inf for an inf/NaN position mismatch); ``worst_index`` is where.
    ``cos_diff`` is FlashMLA's cosine difference (:func:`cosine_diff`); with ``cos_tol`` set, the
    tensor passes only if it is at most that too. It sees what no elementwise bound can: a bias
    that every element carries a little of, such as rounding toward zero."""

    name: str
    ok: bool
    n_bad: int
    worst_abs: float
    worst_rel: float
    worst_index: tuple | None = None
    worst_value: float | None = None
    worst_ref: float | None = None
    special_mismatch: int = 0
    note: str = field(default="")
    worst_excess: float = 0.0
    worst_rel_past_abs: float = 0.0
    cos_diff: float = 0.0
    cos_tol: float | None = None

    def __str__(self):
        s = (f"{self.name}: {'ok' if self.ok else 'FAIL'} (bad {self.n_bad}, inf/nan mismatches "
             f"{self.special_mismatch}, worst abs {self.worst_abs:.3g}, worst rel {self.worst_rel:.3g}, "
             f"cosine diff {self.cos_diff:.3g}")
        if self.worst_index is not None:
            s += (f" at {self.worst_index}: got {self.worst_value:.6g}, ref {self.worst_ref:.6g}, "
                  f"|diff| {abs(self.worst_value - self.worst_ref):.2g}")
        if self.note:
            s += f"; {self.note}"
        return s + ")"


def cosine_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """FlashMLA's cosine difference, as its kernelkit ``check_is_allclose`` computes it: the
    reference in the dtype of ``got`` (FlashMLA's reference output is bf16; ours, float64, is
    rounded to it), both in float32 with inf and nan zeroed, then ``1 - 2<a, r> / (|a|^2 + |r|^2)``
    in float64; 0 when the reference is (nearly) all zero."""
    a = got.detach().float().cpu()
    r = ref.detach().to(got.dtype).float().cpu()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).double()
    r = torch.where(torch.isfinite(r), r, torch.zeros_like(r)).double()
    if float((r * r).sum()) < 1e-12:
        return 0.0
    return 1.0 - 2.0 * float((a * r).sum()) / float((a * a + r * r).sum())


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float,
            cos_tol: float | None = None) -> Closeness:
    """Elementwise: each element within ``abs_tol`` or within ``rel_tol * |ref|``; the positions
    of +inf, -inf and nan must match exactly; and, with ``cos_tol``, FlashMLA's cosine
    difference (:func:`cosine_diff`) at most ``cos_tol``. Reports the worst element and where
    it is."""
    if got.shape != ref.shape:
        return Closeness(name, False, got.numel(), float("inf"), float("inf"),
                         note=f"shape {tuple(got.shape)} != {tuple(ref.shape)}", worst_excess=float("inf"),
                         worst_rel_past_abs=float("inf"))
    g = got.detach().double().cpu()
    r = ref.detach().double().cpu()
    special = (torch.isnan(g) != torch.isnan(r)) | (torch.isposinf(g) != torch.isposinf(r)) \
        | (torch.isneginf(g) != torch.isneginf(r))
    finite = torch.isfinite(r) & torch.isfinite(g)
    err = torch.where(finite, (g - r).abs(), torch.zeros_like(g))
    rel = err / r.abs().clamp_min(1e-300)
    bad = (finite & (err >= abs_tol) & (rel >= rel_tol)) | special
    # "worst" = the element furthest past its allowance
    excess = torch.minimum(err / abs_tol, rel / rel_tol)
    excess = torch.where(special, torch.full_like(excess, float("inf")), excess)
    n_bad = int(bad.sum())
    if g.numel():
        flat = int(torch.argmax(torch.nan_to_num(excess, nan=float("inf"))))
        widx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
        wv, wr = float(g[widx]), float(r[widx])
        wex = float(excess[widx])
        past = finite & (err >= abs_tol)
        rpa = float(torch.where(past, rel, torch.zeros_like(rel)).max())
    else:
        widx = wv = wr = None
        wex = rpa = 0.0
    cos = cosine_diff(got, ref) if g.numel() else 0.0
    ok = n_bad == 0 and (cos_tol is None or abs(cos) <= cos_tol)
    return Closeness(name, ok, n_bad, float(err.max()) if g.numel() else 0.0,
                     float(torch.where(finite, rel, torch.zeros_like(rel)).max()) if g.numel() else 0.0,
                     widx, wv, wr, int(special.sum()), worst_excess=wex, worst_rel_past_abs=rpa, cos_diff=cos,
                     cos_tol=cos_tol)


def check_against_reference(out, lse, ref_out, ref_lse) -> tuple[Closeness, Closeness]:
    """FlashMLA's whole check of (out, lse) against the float64 reference's: the elementwise
    tolerances, the inf/nan positions and the cosine difference."""
    return (compare("out", out, ref_out, OUT_ABS, OUT_REL, OUT_COS),
            compare("lse", lse, ref_lse, LSE_ABS, LSE_REL, LSE_COS))


def check_prefill_against_reference(out, max_logits, lse, ref_out, ref_max_logits, ref_lse,
                                    logit_scale: float = 1.0) -> tuple:
    """FlashMLA's whole check of a sparse prefill's (out, max_logits, lse) against the float64
    reference's (:func:`mla.sparse_prefill_reference` with ``out_dtype=torch.float64``). As
    FlashMLA's test does, out is compared in float32 with the reference unrounded (its cosine
    difference thus counts out's own rounding to bf16). ``logit_scale``: how much larger the
    logits' terms are than on FlashMLA's data (values about 0.1); the absolute bound of max_logits
    and lse grows with it, as the float32 rounding of a dot product's sum does (cancellation leaves
    that error where the logit itself is small)."""
    return (compare("out", out.float(), ref_out, PREFILL_OUT_ABS, PREFILL_OUT_REL, PREFILL_OUT_COS),
            compare("max_logits", max_logits, ref_max_logits, PREFILL_STAT_ABS * logit_scale, PREFILL_STAT_REL,
                    PREFILL_STAT_COS),
            compare("lse", lse, ref_lse, PREFILL_STAT_ABS * logit_scale, PREFILL_STAT_REL, PREFILL_STAT_COS))
