"""Validation against the float64 reference with the SPEC's (FlashMLA's) tolerances."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: out: |err| < 1e-3 or rel < 2.01/128; lse: |err| < 1e-6 or rel < 8.01/65536 (FlashMLA's own).
OUT_ABS, OUT_REL = 1e-3, 2.01 / 128
LSE_ABS, LSE_REL = 1e-6, 8.01 / 65536


@dataclass
class Closeness:
    """Result of comparing one tensor with its reference."""

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

    def __str__(self):
        s = (f"{self.name}: {'ok' if self.ok else 'FAIL'} (bad {self.n_bad}, inf/nan mismatches "
             f"{self.special_mismatch}, worst abs {self.worst_abs:.3g}, worst rel {self.worst_rel:.3g}")
        if self.worst_index is not None:
            s += f" at {self.worst_index}: got {self.worst_value!r}, ref {self.worst_ref!r}"
        return s + ")"


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float) -> Closeness:
    """Elementwise: each element within ``abs_tol`` or within ``rel_tol * |ref|``; the positions
    of +inf, -inf and nan must match exactly. Reports the worst element and where it is."""
    if got.shape != ref.shape:
        return Closeness(name, False, got.numel(), float("inf"), float("inf"),
                         note=f"shape {tuple(got.shape)} != {tuple(ref.shape)}")
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
    else:
        widx = wv = wr = None
    return Closeness(name, n_bad == 0, n_bad, float(err.max()) if g.numel() else 0.0,
                     float(torch.where(finite, rel, torch.zeros_like(rel)).max()) if g.numel() else 0.0,
                     widx, wv, wr, int(special.sum()))


def check_against_reference(out, lse, ref_out, ref_lse) -> tuple[Closeness, Closeness]:
    """The SPEC's tolerance check of (out, lse) against the float64 reference's."""
    return (compare("out", out, ref_out, OUT_ABS, OUT_REL),
            compare("lse", lse, ref_lse, LSE_ABS, LSE_REL))
