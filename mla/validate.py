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


# --------------------------------------------------------------------------------------------
# Cases: fresh random data, every kind of invalid index, NaN-filled unreferenced bytes.

INVALID_KINDS = ("-1", "int32 min", "int32 max", "just past the end")


def invalid_values(n_tokens: int) -> list[int]:
    """One index of each invalid kind for a cache of ``n_tokens`` tokens."""
    return [-1, -2 ** 31, 2 ** 31 - 1, n_tokens]


def poison_unreferenced(cache: torch.Tensor, used: torch.Tensor) -> None:
    """Fill, in place, every byte of ``cache`` that no index in ``used`` refers to with NaN bytes:
    0x7F (e4m3 NaN) in nope, 0xFF in rope (bf16 NaN) and in UE8M0 scales (NaN), and 0x7F in the
    stride padding. Indices outside the cache are ignored. A kernel that reads, or multiplies by
    zero, any byte it must not use, then produces NaN."""
    from .layout import DATA_BYTES, NOPE_BYTES, TOKEN_BYTES

    nb, p = cache.shape[0], cache.shape[1]
    ps = cache.stride(0)
    flat = torch.as_strided(cache.view(torch.uint8), (nb, ps), (ps, 1))
    keep = torch.zeros(nb * p, dtype=torch.bool, device=cache.device)
    u = used.reshape(-1).long()
    keep[u[(u >= 0) & (u < nb * p)]] = True
    drop = ~keep.view(nb, p)
    data = flat[:, : p * DATA_BYTES].view(nb, p, DATA_BYTES)
    scales = flat[:, p * DATA_BYTES: p * TOKEN_BYTES].view(nb, p, TOKEN_BYTES - DATA_BYTES)
    data[..., :NOPE_BYTES].masked_fill_(drop[..., None], 0x7F)
    data[..., NOPE_BYTES:].masked_fill_(drop[..., None], 0xFF)
    scales.masked_fill_(drop[..., None], 0xFF)
    if ps > p * TOKEN_BYTES:
        flat[:, p * TOKEN_BYTES:] = 0x7F


def _valid_positions(indices, length):
    if length is None:
        return indices
    pos = torch.arange(indices.shape[-1], device=indices.device).view(1, 1, -1)
    return torch.where(pos < length.view(-1, 1, 1), indices, torch.full_like(indices, -1))


def make_case(b=2, s_q=1, h_q=4, topk=32, page=16, num_blocks=None, extra_topk=0, extra_page=8,
              lengths=False, sink=True, invalid_frac=0.1, empty_query=False, device="cpu", seed=0) -> dict:
    """Fresh random inputs for one call: q, caches of quantized N(0, 1) latents, indices with
    ``invalid_frac`` of every invalid kind, optional lengths (one of them 0), a sink with +inf
    and -inf entries, and every unreferenced cache byte NaN. Returns the keyword arguments of
    :func:`mla.sparse_decode` (without ``impl``)."""
    from .layout import D_QK, quantize_kv

    g = torch.Generator(device="cpu").manual_seed(seed)

    def cache_and_indices(k, pg, nblk):
        nblk = nblk or max(2, -(-b * s_q * k // pg) + 1)
        cache = quantize_kv(torch.randn(nblk, pg, D_QK, generator=g).bfloat16()).to(device)
        n = nblk * pg
        idx = torch.randint(0, n, (b, s_q, k), generator=g, dtype=torch.int32)
        bad = torch.rand(b, s_q, k, generator=g) < invalid_frac
        kinds = torch.tensor(invalid_values(n), dtype=torch.int32)
        idx = torch.where(bad, kinds[torch.randint(0, len(kinds), (b, s_q, k), generator=g)], idx)
        return cache, idx.to(device)

    kw = {}
    kw["k_cache"], kw["indices"] = cache_and_indices(topk, page, num_blocks)
    if empty_query:
        kw["indices"][0, 0, :] = -1
    kw["q"] = torch.randn(b, s_q, h_q, D_QK, generator=g).bfloat16().to(device)
    if sink:
        s = torch.randn(h_q, generator=g)
        s[0] = float("inf")
        if h_q > 1:
            s[1] = float("-inf")
        kw["attn_sink"] = s.to(device)
    if lengths:
        tl_ = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32)
        tl_[-1] = 0
        kw["topk_length"] = tl_.to(device)
    if extra_topk:
        kw["extra_k_cache"], kw["extra_indices"] = cache_and_indices(extra_topk, extra_page, None)
        if lengths:
            kw["extra_topk_length"] = torch.randint(0, extra_topk + 1, (b,), generator=g, dtype=torch.int32).to(device)
        poison_unreferenced(kw["extra_k_cache"], _valid_positions(kw["extra_indices"], kw.get("extra_topk_length")))
    poison_unreferenced(kw["k_cache"], _valid_positions(kw["indices"], kw.get("topk_length")))
    return kw


def poison_allocator(nbytes: int, device) -> None:
    """Hand the caching allocator a NaN-filled block, so that the next ``torch.empty`` of about
    that size (a kernel's output) starts as NaN rather than as stale, plausible numbers."""
    t = torch.full((max(1, nbytes // 4),), float("nan"), device=device)
    del t


def run_case(fn, case: dict) -> tuple[Closeness, Closeness]:
    """Call ``fn(**case)`` (outputs poisoned first) and compare with the float64 reference."""
    from .reference import sparse_decode_reference

    q = case["q"]
    b, s_q, h_q, d = q.shape
    poison_allocator(b * s_q * h_q * d * 8, q.device)
    out, lse = fn(**case)
    ref_out, ref_lse = sparse_decode_reference(**case, out_dtype=torch.float64)
    return check_against_reference(out, lse, ref_out, ref_lse)
