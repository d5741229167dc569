"""Validation against the float64 reference with the SPEC's (FlashMLA's) tolerances.

Three lines validate your own sparse-decode function, one with the signature of
:func:`mla.sparse_decode` (``fn(q, k_cache, indices, *, softmax_scale, attn_sink, topk_length,
extra_k_cache, extra_indices, extra_topk_length) -> (out, lse)``)::

    import mla.validate as mv
    report = mv.validate(my_sparse_decode)      # every hard case, on the GPU when there is one
    assert report.ok, report                    # a table: each case, its worst element and where

What it checks, per case (:func:`make_case`, :class:`CaseSpec`):

- fresh random q and caches (quantized N(0, 1) latents) per case; indices with every kind of
  invalid entry (``-1``, INT32 min, INT32 max, ``num_blocks * P``); optional ``topk_length``
  (one of them 0), an extra cache with its own page size, a sink with ``+inf`` and ``-inf``
  entries, a query with no valid token at all;
- every cache byte that no valid index refers to is filled with NaN bytes (fp8 ``0x7F``, bf16
  and UE8M0 ``0xFF``), and the output memory is poisoned with NaN before the call;
- out and lse against the float64 reference on the dequantized cache with FlashMLA's whole
  check (:func:`check_against_reference`): out ``|err| < 1e-3`` or ``rel < 2.01/128``, lse
  ``|err| < 1e-6`` or ``rel < 8.01/65536``, the positions of inf and NaN exactly, and the cosine
  difference (:func:`cosine_diff`) at most 5e-6 for out and 1e-7 for lse; the worst element and
  its index are reported beside the cosine difference;
- dtypes (out bf16, lse fp32), no NaN anywhere, and (``leak_check``) that the answer is the same
  bit for bit when the unreferenced bytes hold zeros instead of NaN: nothing the call must not
  read may change what it returns.

:func:`sweep` runs several impls over many cases into a pandas DataFrame (one row per case and
impl, with a tqdm progress bar), :func:`table` renders it with rich, :func:`summary` condenses it.
Case sets: :func:`quick_cases` (tiny, for the CPU interpreter), :func:`odd_cases` (a pairwise
covering grid of odd shapes), :func:`benchmark_cases` (the SPEC's production shapes over a large
pool), :func:`cases` (your own grid). :data:`BROKEN` holds deliberately wrong implementations
that the harness must catch.
"""
from __future__ import annotations

import functools
import io
import itertools
import math
import time
from dataclasses import asdict, dataclass, field, fields

import torch

#: out: |err| < 1e-3 or rel < 2.01/128; lse: |err| < 1e-6 or rel < 8.01/65536 (FlashMLA's own).
OUT_ABS, OUT_REL = 1e-3, 2.01 / 128
LSE_ABS, LSE_REL = 1e-6, 8.01 / 65536
#: FlashMLA's cosine-difference bounds (its decode test's check_is_allclose): out 5e-6, lse 1e-7.
OUT_COS, LSE_COS = 5e-6, 1e-7


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
            s += f" at {self.worst_index}: got {self.worst_value!r}, ref {self.worst_ref!r}"
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


# --------------------------------------------------------------------------------------------
# Cases: fresh random data, every kind of invalid index, NaN-filled unreferenced bytes.

INVALID_KINDS = ("-1", "int32 min", "int32 max", "just past the end")


def invalid_values(n_tokens: int) -> list[int]:
    """One index of each invalid kind for a cache of ``n_tokens`` tokens."""
    return [-1, -2 ** 31, 2 ** 31 - 1, n_tokens]


def _fill_unreferenced(cache: torch.Tensor, used: torch.Tensor, nope: int, rope: int, scale: int, pad: int) -> None:
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
    data[..., :NOPE_BYTES].masked_fill_(drop[..., None], nope)
    data[..., NOPE_BYTES:].masked_fill_(drop[..., None], rope)
    scales.masked_fill_(drop[..., None], scale)
    if ps > p * TOKEN_BYTES:
        flat[:, p * TOKEN_BYTES:] = pad


def poison_unreferenced(cache: torch.Tensor, used: torch.Tensor) -> None:
    """Fill, in place, every byte of ``cache`` that no index in ``used`` refers to with NaN bytes:
    0x7F (e4m3 NaN) in nope, 0xFF in rope (bf16 NaN) and in UE8M0 scales (NaN), and 0x7F in the
    stride padding. Indices outside the cache are ignored. A kernel that reads, or multiplies by
    zero, any byte it must not use, then produces NaN."""
    _fill_unreferenced(cache, used, 0x7F, 0xFF, 0xFF, 0x7F)


def _valid_positions(indices, length):
    if length is None:
        return indices
    pos = torch.arange(indices.shape[-1], device=indices.device).view(1, 1, -1)
    return torch.where(pos < length.view(-1, 1, 1), indices, torch.full_like(indices, -1))


#: Above this many tokens a cache for a CUDA device is generated on the device (fast), not on
#: the CPU.
_DEVICE_GEN_TOKENS = 1 << 18


def make_case(b=2, s_q=1, h_q=4, topk=32, page=16, num_blocks=None, extra_topk=0, extra_page=8,
              lengths=False, sink=True, invalid_frac=0.1, empty_query=False, device="cpu", seed=0,
              extra_num_blocks=None, sink_inf=True, softmax_scale=None, q_scale=1.0) -> dict:
    """Fresh random inputs for one call: q, caches of quantized N(0, 1) latents, indices with
    ``invalid_frac`` of every invalid kind, optional lengths (one of them 0), a sink with +inf
    and -inf entries (``sink_inf``; else all finite), and every unreferenced cache byte NaN.
    ``empty_query`` leaves query (0, 0) with no valid token in either cache. ``q_scale``
    multiplies q (large scores: a peaked softmax). Returns the keyword arguments of
    :func:`mla.sparse_decode` (without ``impl``). Caches of more than 2**18 tokens for a CUDA
    device are generated on the device."""
    from .layout import D_QK, quantize_kv

    g = torch.Generator(device="cpu").manual_seed(seed)
    device = torch.device(device)

    def cache_and_indices(k, pg, nblk):
        nblk = nblk or max(2, -(-b * s_q * k // pg) + 1)
        n = nblk * pg
        if device.type == "cuda" and n > _DEVICE_GEN_TOKENS:
            from .bench import random_cache

            gd = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=g)))
            cache = random_cache(nblk, pg, device, gd)
        else:
            cache = quantize_kv(torch.randn(nblk, pg, D_QK, generator=g).bfloat16()).to(device)
        idx = torch.randint(0, n, (b, s_q, k), generator=g, dtype=torch.int32)
        bad = torch.rand(b, s_q, k, generator=g) < invalid_frac
        kinds = torch.tensor(invalid_values(n), dtype=torch.int32)
        idx = torch.where(bad, kinds[torch.randint(0, len(kinds), (b, s_q, k), generator=g)], idx)
        if empty_query:
            idx[0, 0, :] = kinds[torch.arange(k) % len(kinds)]
        return cache, idx.to(device)

    kw = {}
    kw["k_cache"], kw["indices"] = cache_and_indices(topk, page, num_blocks)
    q = torch.randn(b, s_q, h_q, D_QK, generator=g)
    kw["q"] = (q * q_scale if q_scale != 1.0 else q).bfloat16().to(device)
    if sink:
        s = torch.randn(h_q, generator=g)
        if sink_inf:
            s[0] = float("inf")
            if h_q > 1:
                s[1] = float("-inf")
        kw["attn_sink"] = s.to(device)
    if lengths:
        tl_ = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32)
        tl_[-1] = 0
        kw["topk_length"] = tl_.to(device)
    if extra_topk:
        kw["extra_k_cache"], kw["extra_indices"] = cache_and_indices(extra_topk, extra_page, extra_num_blocks)
        if lengths:
            kw["extra_topk_length"] = torch.randint(0, extra_topk + 1, (b,), generator=g, dtype=torch.int32).to(device)
        poison_unreferenced(kw["extra_k_cache"], _valid_positions(kw["extra_indices"], kw.get("extra_topk_length")))
    poison_unreferenced(kw["k_cache"], _valid_positions(kw["indices"], kw.get("topk_length")))
    if softmax_scale is not None:
        kw["softmax_scale"] = float(softmax_scale)
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


# --------------------------------------------------------------------------------------------
# Case specifications and case sets.

@dataclass(frozen=True)
class CaseSpec:
    """One validation case: the arguments of :func:`make_case` and a name. ``make(device)``
    builds fresh random inputs (deterministic in ``seed``)."""

    name: str
    b: int = 2
    s_q: int = 1
    h_q: int = 4
    topk: int = 32
    page: int = 16
    num_blocks: int | None = None
    extra_topk: int = 0
    extra_page: int = 8
    extra_num_blocks: int | None = None
    lengths: bool = False
    sink: bool = True
    sink_inf: bool = True
    invalid_frac: float = 0.1
    empty_query: bool = False
    softmax_scale: float | None = None
    q_scale: float = 1.0
    seed: int = 0

    def kwargs(self) -> dict:
        d = asdict(self)
        d.pop("name")
        return d

    def make(self, device="cpu") -> dict:
        return make_case(**self.kwargs(), device=device)

    @property
    def sink_kind(self) -> str:
        return "none" if not self.sink else ("±inf" if self.sink_inf else "finite")


_SPEC_FIELDS = {f.name for f in fields(CaseSpec)}


def _as_spec(c, i: int = 0) -> CaseSpec:
    if isinstance(c, CaseSpec):
        return c
    if isinstance(c, dict):
        d = dict(c)
        d.setdefault("name", f"case {i}")
        unknown = set(d) - _SPEC_FIELDS
        if unknown:
            raise ValueError(f"cases: unknown case fields {sorted(unknown)}; known: {sorted(_SPEC_FIELDS)}")
        return CaseSpec(**d)
    raise TypeError(f"cases: expected CaseSpec or dict, got {type(c).__name__}")


def cases(grid: dict | None = None, name: str = "grid", **base) -> list[CaseSpec]:
    """Every combination of the values in ``grid`` ({field: [values]}) over the fields ``base``,
    e.g. ``cases({"h_q": [1, 64], "page": [7, 64]}, topk=40)``; seeds differ per case."""
    grid = grid or {}
    keys = list(grid)
    out = []
    for i, vals in enumerate(itertools.product(*(grid[k] for k in keys))):
        d = dict(base, **dict(zip(keys, vals)))
        label = " ".join(f"{k}={v}" for k, v in zip(keys, vals))
        d.setdefault("seed", i)
        out.append(_as_spec(dict(d, name=f"{name} {label}".strip()), i))
    return out


def quick_cases() -> list[CaseSpec]:
    """Tiny cases with every trap of the SPEC, each a second or two on the CPU interpreter."""
    return [
        CaseSpec("plain", b=2, s_q=1, h_q=4, topk=40, page=16, seed=1),
        CaseSpec("extra+lengths+empty", b=2, s_q=2, h_q=3, topk=33, page=61, extra_topk=20, extra_page=13,
                 lengths=True, empty_query=True, seed=2),
        CaseSpec("h1 topk1 P1", b=2, s_q=1, h_q=1, topk=1, page=1, num_blocks=3, sink_inf=False, seed=3),
        CaseSpec("h20 s_q2 P7", b=1, s_q=2, h_q=20, topk=17, page=7, sink=False, seed=4),
        CaseSpec("nothing valid, s_q3, extra P1", b=1, s_q=3, h_q=5, topk=9, page=4, extra_topk=11, extra_page=1,
                 invalid_frac=1.0, seed=5),
        CaseSpec("peaked softmax, duplicates", b=1, s_q=1, h_q=6, topk=50, page=4, num_blocks=2, q_scale=8.0,
                 softmax_scale=0.1, sink_inf=False, seed=6),
    ]


def _pairwise(factors: dict) -> list[dict]:
    """A deterministic greedy covering array: every pair of values of any two factors appears in
    at least one row (far fewer rows than the full product)."""
    names = list(factors)
    nval = [len(factors[n]) for n in names]
    uncovered = {(i, a, j, c) for i, j in itertools.combinations(range(len(names)), 2)
                 for a in range(nval[i]) for c in range(nval[j])}
    used = [[0] * n for n in nval]

    def pair(k, v, m, w):
        return (k, v, m, w) if k < m else (m, w, k, v)

    rows = []
    while uncovered:
        i, a, j, c = min(uncovered)
        row = {i: a, j: c}
        for k in range(len(names)):
            if k in row:
                continue
            row[k] = max(range(nval[k]), key=lambda v: (sum(pair(k, v, m, w) in uncovered for m, w in row.items()),
                                                        -used[k][v], -v))
        for k, m in itertools.combinations(range(len(names)), 2):
            uncovered.discard((k, row[k], m, row[m]))
        for k, v in row.items():
            used[k][v] += 1
        rows.append({names[k]: factors[names[k]][row[k]] for k in range(len(names))})
    return rows


#: The odd-shape axes of :func:`odd_cases`.
ODD_AXES = {
    "h_q": [1, 3, 8, 20, 64, 128],
    "page": [1, 7, 61, 64, 256],
    "topk": [1, 17, 100, 640],
    "s_q": [1, 2, 3],
    "extra": [None, (5, 1), (17, 13), (512, 64)],       # (extra_topk, extra P)
    "lengths": [False, True],
    "sink": ["±inf", "finite", "none"],
}


def odd_cases() -> list[CaseSpec]:
    """Odd shapes: a pairwise covering of :data:`ODD_AXES` (every pair of values of any two
    axes appears in some case), plus edge cases the grid cannot express: everything invalid,
    heavy duplicate indices, a peaked softmax with a non-default scale, and one query token with
    no valid token in every few cases."""
    out = []
    for i, r in enumerate(_pairwise(ODD_AXES)):
        et, ep = r["extra"] or (0, 8)
        d = dict(b=1 + i % 3, s_q=r["s_q"], h_q=r["h_q"], topk=r["topk"], page=r["page"], extra_topk=et,
                 extra_page=ep, lengths=r["lengths"], sink=r["sink"] != "none", sink_inf=r["sink"] == "±inf",
                 empty_query=i % 4 == 1, invalid_frac=(0.1, 0.0, 0.3)[i % 3], seed=100 + i)
        label = (f"h{r['h_q']} s{r['s_q']} topk{r['topk']} P{r['page']}" + (f" +x{et}/P{ep}" if et else "")
                 + (" len" if r["lengths"] else "") + f" sink:{r['sink']}")
        out.append(CaseSpec(f"odd {i:02d} {label}", **d))
    out += [
        CaseSpec("all invalid", b=2, s_q=2, h_q=8, topk=64, page=64, extra_topk=64, extra_page=64,
                 invalid_frac=1.0, seed=200),
        CaseSpec("duplicates", b=2, s_q=1, h_q=64, topk=640, page=7, num_blocks=3, seed=201),
        CaseSpec("peaked softmax", b=2, s_q=2, h_q=20, topk=100, page=61, extra_topk=17, extra_page=13,
                 q_scale=8.0, softmax_scale=0.1, seed=202),
        CaseSpec("one valid token", b=3, s_q=1, h_q=64, topk=640, page=64, extra_topk=64, extra_page=64,
                 invalid_frac=0.999, sink_inf=False, seed=203),
    ]
    return out


def benchmark_cases(pool_bytes: float = 5e8) -> list[CaseSpec]:
    """The SPEC's benchmark shapes (:func:`mla.bench.spec_shapes`) over a main pool of about
    ``pool_bytes`` (the extra cache gets half), random indices, 5% of them invalid."""
    from .bench import spec_shapes
    from .layout import page_stride

    out = []
    for i, s in enumerate(spec_shapes()):
        nb = max(2, int(pool_bytes // page_stride(s.page)))
        enb = max(2, int(pool_bytes // 2 // page_stride(s.extra_page))) if s.extra_topk else None
        out.append(CaseSpec(f"{s.name} b{s.b}", b=s.b, s_q=s.s_q, h_q=s.h_q, topk=s.topk, page=s.page,
                            num_blocks=nb, extra_topk=s.extra_topk, extra_page=s.extra_page, extra_num_blocks=enb,
                            invalid_frac=0.05, seed=300 + i))
    return out


# --------------------------------------------------------------------------------------------
# Checking one call, sweeping many.

def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _impl_fns(impls) -> dict:
    """{name: fn} from a name, a list of names and/or callables, or a dict."""
    import mla

    if isinstance(impls, dict):
        return dict(impls)
    if isinstance(impls, str) or callable(impls):
        impls = [impls]
    out = {}
    for x in impls:
        if isinstance(x, str):
            out[x] = functools.partial(mla.sparse_decode, impl=x)
        elif callable(x):
            out[_unique(_fn_name(x), out)] = x
        else:
            raise TypeError(f"impls: expected names or callables, got {type(x).__name__}")
    return out


def _fn_name(fn) -> str:
    if isinstance(fn, functools.partial):
        if "impl" in fn.keywords:
            return str(fn.keywords["impl"])
        return _fn_name(fn.func)
    return getattr(fn, "__name__", type(fn).__name__)


def _unique(name: str, taken) -> str:
    n, i = name, 2
    while n in taken:
        n, i = f"{name} ({i})", i + 1
    return n


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _clone_cache(cache: torch.Tensor) -> torch.Tensor:
    """A copy with the same shape and strides (the stride padding included)."""
    nb, ps = cache.shape[0], cache.stride(0)
    src = torch.as_strided(cache.view(torch.uint8), (nb, ps), (ps, 1))
    buf = src.clone()
    return buf.view(-1).as_strided(cache.shape, cache.stride()).view(cache.dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if a.element_size() in ints and a.is_contiguous() and b.is_contiguous():
        return torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))
    return bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan()))


def unreferenced_invariant(fn, case: dict, out: torch.Tensor, lse: torch.Tensor) -> bool:
    """Call ``fn`` again on copies of the caches whose unreferenced bytes hold zeros instead of
    NaN; True iff it returns the same (out, lse) bit for bit. A call that reads any byte it
    must not (an invalid index, a position past a length, another token, the padding) can be
    caught this way even when it never turns the NaN into a visible NaN."""
    alt = dict(case)
    for ck, ik, lk in (("k_cache", "indices", "topk_length"), ("extra_k_cache", "extra_indices", "extra_topk_length")):
        if case.get(ck) is None:
            continue
        c = _clone_cache(case[ck])
        _fill_unreferenced(c, _valid_positions(case[ik], case.get(lk)), 0, 0, 0x7F, 0)   # zeros; scale 2**0
        alt[ck] = c
    q = case["q"]
    poison_allocator(q.numel() * 8, q.device)
    out2, lse2 = fn(**alt)
    _sync(q.device)
    return _same_bits(out, out2) and _same_bits(lse, lse2)


def _where(idx, dims) -> str:
    return "-" if idx is None else " ".join(f"{d}{i}" for d, i in zip(dims, idx))


def _num(x):
    """A JSON-safe float: inf and nan as strings."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


ROW_COLUMNS = ["case", "impl", "b", "s_q", "h_q", "topk", "page", "extra_topk", "extra_page", "lengths", "sink",
               "empty_query", "invalid_frac", "ok", "n_bad", "out_bad", "lse_bad", "out_max_abs", "out_max_rel",
               "out_excess", "out_worst_at", "out_worst_got", "out_worst_ref", "out_cos", "lse_max_abs", "lse_max_rel",
               "lse_excess", "lse_worst_at", "lse_worst_got", "lse_worst_ref", "lse_cos", "dtype_ok", "nan_count",
               "leak_ok", "seconds", "crashed", "error"]


def _spec_fields(spec: CaseSpec) -> dict:
    return dict(case=spec.name, b=spec.b, s_q=spec.s_q, h_q=spec.h_q, topk=spec.topk, page=spec.page,
                extra_topk=spec.extra_topk, extra_page=spec.extra_page if spec.extra_topk else None,
                lengths=spec.lengths, sink=spec.sink_kind, empty_query=spec.empty_query,
                invalid_frac=spec.invalid_frac)


def _error_row(spec, name, msg, seconds=None) -> dict:
    row = dict.fromkeys(ROW_COLUMNS)
    row.update(_spec_fields(spec), impl=name, ok=False, seconds=seconds, crashed=True, error=msg)
    return row


def _check(spec: CaseSpec, name: str, fn, case: dict, ref, leak_check: bool) -> dict:
    dev = case["q"].device
    t0 = time.perf_counter()
    try:
        q = case["q"]
        poison_allocator(q.numel() * 8, dev)
        out, lse = fn(**case)
        _sync(dev)
        secs = time.perf_counter() - t0
        co, cl = check_against_reference(out, lse, *ref)
        dtype_ok = out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        nan_count = int(torch.isnan(out).sum()) + int(torch.isnan(lse).sum())
        leak_ok = unreferenced_invariant(fn, case, out, lse) if leak_check else None
    except Exception as e:  # noqa: BLE001  (a crash is a failure of that case, reported)
        if dev.type == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
        return _error_row(spec, name, f"{type(e).__name__}: {str(e)[:400]}", time.perf_counter() - t0)
    ok = co.ok and cl.ok and dtype_ok and nan_count == 0 and leak_ok is not False
    notes = []
    if not dtype_ok:
        notes.append(f"dtypes out {out.dtype}, lse {lse.dtype} (want bfloat16, float32)")
    for c in (co, cl):
        if c.note:
            notes.append(f"{c.name}: {c.note}")
    if leak_ok is False:
        notes.append("result depends on unreferenced bytes")
    row = _spec_fields(spec)
    row.update(impl=name, ok=ok, n_bad=co.n_bad + cl.n_bad, out_bad=co.n_bad, lse_bad=cl.n_bad,
               out_max_abs=co.worst_abs, out_max_rel=co.worst_rel_past_abs, out_excess=co.worst_excess,
               out_worst_at=_where(co.worst_index, "bshc"), out_worst_got=co.worst_value, out_worst_ref=co.worst_ref,
               out_cos=co.cos_diff, lse_max_abs=cl.worst_abs, lse_max_rel=cl.worst_rel_past_abs,
               lse_excess=cl.worst_excess, lse_worst_at=_where(cl.worst_index, "bhs"), lse_worst_got=cl.worst_value,
               lse_worst_ref=cl.worst_ref, lse_cos=cl.cos_diff,
               dtype_ok=dtype_ok, nan_count=nan_count, leak_ok=leak_ok, seconds=secs, crashed=False,
               error="; ".join(notes) or None)
    return row


def check(fn, case, device=None, *, leak_check: bool = True, name: str | None = None) -> dict:
    """Validate one call of ``fn`` on one case (a :class:`CaseSpec` or its fields as a dict):
    one row of :func:`sweep`, as a dict (``row["ok"]``)."""
    return sweep_rows({name or _fn_name(fn): fn}, [case], device, progress=False,
                      leak_check=leak_check)[0]


def _progress(total, enabled):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:           # tqdm is optional
        return None
    return tqdm(total=total, desc="mla.validate", leave=False)


def sweep_rows(impls, cases, device=None, *, progress: bool = True, leak_check: bool = True,
               batch_chunk: int | None = None) -> list[dict]:
    """:func:`sweep` as a list of row dicts (needs neither pandas nor tqdm)."""
    from .reference import sparse_decode_reference

    fns = _impl_fns(impls)
    device = torch.device(device) if device is not None else _default_device()
    specs = [_as_spec(c, i) for i, c in enumerate(cases)]
    rows = []
    bar = _progress(len(specs) * len(fns), progress)
    for spec in specs:
        if bar is not None:
            bar.set_postfix_str(spec.name[:40])
        t0 = time.perf_counter()
        try:
            case = spec.make(device)
            ref = sparse_decode_reference(**case, out_dtype=torch.float64, batch_chunk=batch_chunk)
            _sync(device)
        except Exception as e:  # noqa: BLE001
            msg = f"case setup: {type(e).__name__}: {str(e)[:400]}"
            rows += [_error_row(spec, n, msg, time.perf_counter() - t0) for n in fns]
            if bar is not None:
                bar.update(len(fns))
            continue
        for name, fn in fns.items():
            rows.append(_check(spec, name, fn, case, ref, leak_check))
            if bar is not None:
                bar.update(1)
        del case, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if bar is not None:
        bar.close()
    return rows


def sweep(impls, cases, device=None, *, progress: bool = True, leak_check: bool = True,
          batch_chunk: int | None = None):
    """Run every impl on every case and check it; returns a pandas DataFrame with one row per
    (case, impl) (columns :data:`ROW_COLUMNS`; :func:`sweep_rows` gives the same rows as dicts).

    ``impls``: a name (``"mma"``: :func:`mla.sparse_decode` with that ``impl``), a callable
    with the signature of :func:`mla.sparse_decode`, a list of those, or ``{name: fn}``.
    ``cases``: :class:`CaseSpec` objects (or dicts of their fields). Each case's inputs are built
    once on ``device`` (default: the GPU if there is one) and its float64 reference computed
    once; then every impl is called with its output memory poisoned (a tqdm bar counts the
    calls). A crash is a failed row with the message in ``error``. Row fields: ``ok``;
    ``n_bad`` (elements outside tolerance); ``out_max_abs`` (largest |err|), ``out_max_rel``
    (largest relative error among elements past the absolute allowance: passes when
    < 2.01/128), ``out_excess`` (the worst element's error over its allowance: passes when < 1)
    and ``out_worst_at`` (its index, ``b s h c``), the same for lse (index ``b h s``);
    ``nan_count``; ``leak_ok`` (:func:`unreferenced_invariant`, None when not run); ``seconds``
    (the call, compilation included)."""
    import pandas as pd

    return pd.DataFrame(sweep_rows(impls, cases, device, progress=progress, leak_check=leak_check,
                                   batch_chunk=batch_chunk), columns=ROW_COLUMNS)


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _rows(x) -> list[dict]:
    """Rows as dicts, from a DataFrame or a list; pandas' NaN placeholders become None."""
    recs = x.to_dict("records") if hasattr(x, "to_dict") else list(x)
    return [{k: (None if _missing(v) else (v.item() if hasattr(v, "item") else v)) for k, v in r.items()} for r in recs]


def summary(rows) -> dict:
    """The sweep (a DataFrame or rows) in numbers, JSON-safe: cases, rows, failures (must be 0),
    crashes, the worst errors over all rows, the NaN-leak checks, per impl, the failed rows."""
    rows = _rows(rows)

    def as_float(x):
        try:
            return float(x)          # rows that went through JSON hold "inf" / "nan" as strings
        except (TypeError, ValueError):
            return None

    def worst(col, sub=rows):
        v = [f for f in (as_float(r.get(col)) for r in sub) if f is not None and f == f]
        return _num(max(v)) if v else None

    per_impl = {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        sub = [r for r in rows if r["impl"] == impl]
        per_impl[impl] = {"rows": len(sub), "failures": sum(not r["ok"] for r in sub),
                          "worst_out_abs": worst("out_max_abs", sub), "worst_out_excess": worst("out_excess", sub),
                          "worst_out_cos": worst("out_cos", sub),
                          "worst_lse_abs": worst("lse_max_abs", sub), "worst_lse_excess": worst("lse_excess", sub),
                          "worst_lse_cos": worst("lse_cos", sub)}

    def why(r):
        if r.get("error"):
            return r["error"]
        return (f"out bad {_fmt(r['out_bad'], 'd')} (worst at {r['out_worst_at']}), cosine diff {_fmt(r.get('out_cos'))}, "
                f"lse bad {_fmt(r['lse_bad'], 'd')}, cosine diff {_fmt(r.get('lse_cos'))}, "
                f"NaN {_fmt(r['nan_count'], 'd')}, leak check {'failed' if r['leak_ok'] is False else 'ok'}")

    return {
        "cases": len({r["case"] for r in rows}), "rows": len(rows), "impls": list(per_impl),
        "failures": sum(not r["ok"] for r in rows), "crashes": sum(bool(r.get("crashed")) for r in rows),
        "worst_out_abs": worst("out_max_abs"), "worst_out_rel": worst("out_max_rel"),
        "worst_out_excess": worst("out_excess"), "worst_out_cos": worst("out_cos"),
        "worst_lse_abs": worst("lse_max_abs"), "worst_lse_rel": worst("lse_max_rel"),
        "worst_lse_excess": worst("lse_excess"), "worst_lse_cos": worst("lse_cos"),
        "tolerances": {"out_abs": OUT_ABS, "out_rel": OUT_REL, "out_cos": OUT_COS, "lse_abs": LSE_ABS,
                       "lse_rel": LSE_REL, "lse_cos": LSE_COS},
        "nan_leak_checks": {"rows_checked_for_nan": sum(r.get("nan_count") is not None for r in rows),
                            "rows_with_nan": sum((r.get("nan_count") or 0) > 0 for r in rows),
                            "unreferenced_invariance_run": sum(r.get("leak_ok") is not None for r in rows),
                            "unreferenced_invariance_failed": sum(r.get("leak_ok") is False for r in rows)},
        "per_impl": per_impl, "failed": [f"{r['case']} / {r['impl']}: {why(r)}" for r in rows if not r["ok"]],
    }


def _fmt(x, spec=".2g"):
    if _missing(x):
        return "-"
    if isinstance(x, str):
        return x
    if spec == "d":
        return str(int(x))
    return format(float(x), spec)


_TABLE_COLUMNS = ("case", "impl", "ok", "out bad", "out max|err|", "out worst/allow", "out worst at", "out cos/allow",
                  "lse bad", "lse worst/allow", "lse worst at", "lse cos/allow", "NaN", "leak", "s", "note")


def _cos_share(x, tol):
    return "-" if _missing(x) else _fmt(abs(float(x)) / tol)


def _table_cells(r) -> list[str]:
    leak = {True: "ok", False: "LEAK"}.get(r["leak_ok"], "-")
    return [str(r["case"]), str(r["impl"]), "ok" if r["ok"] else "FAIL", _fmt(r["out_bad"], "d"),
            _fmt(r["out_max_abs"]), _fmt(r["out_excess"]), _fmt(r["out_worst_at"]), _cos_share(r.get("out_cos"), OUT_COS),
            _fmt(r["lse_bad"], "d"), _fmt(r["lse_excess"]), _fmt(r["lse_worst_at"]), _cos_share(r.get("lse_cos"), LSE_COS),
            _fmt(r["nan_count"], "d"), leak, _fmt(r["seconds"], ".2f"), (r["error"] or "")[:80]]


def table(rows, title: str = "mla.validate", max_rows: int | None = None, width: int = 200,
          failures_first: bool = True) -> str:
    """Render a sweep (a DataFrame or rows) as a table, failures first; returns the text (print
    it). "worst/allow" is the worst element's error over its allowance (it passes below 1);
    "at" is its index (out: ``b s h c``, lse: ``b h s``); "cos/allow" the cosine difference over
    FlashMLA's bound (it passes at 1 or below). Uses rich when it is installed."""
    rows = _rows(rows)
    s = summary(rows)
    if failures_first:
        rows = sorted(rows, key=lambda r: bool(r["ok"]))
    if max_rows is not None:
        rows = rows[:max_rows]
    head = (f"{title}: {s['rows']} runs ({s['cases']} cases x {len(s['impls'])} impls), "
            f"{s['failures']} failed")
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:           # rich is optional: plain columns
        cells = [list(_TABLE_COLUMNS)] + [_table_cells(r) for r in rows]
        w = [max(len(c[i]) for c in cells) for i in range(len(_TABLE_COLUMNS))]
        return "\n".join([head] + ["  ".join(c[i].ljust(w[i]) for i in range(len(w))) for c in cells]) + "\n"
    t = Table(title=head, title_justify="left")
    for col in _TABLE_COLUMNS:
        t.add_column(col, justify="left" if col in ("case", "impl", "out worst at", "lse worst at", "note")
                     else "right", overflow="fold")
    style = {"ok": "[green]ok[/green]", "FAIL": "[bold red]FAIL[/bold red]", "LEAK": "[bold red]LEAK[/bold red]"}
    for r in rows:
        t.add_row(*[style.get(c, escape(c)) if i in (2, 13) else escape(c) for i, c in enumerate(_table_cells(r))])
    con = Console(width=width, record=True, file=io.StringIO(), force_terminal=False, force_jupyter=False)
    con.print(t)
    return con.export_text()


@dataclass
class Report:
    """What :func:`validate` returns: ``ok``, the ``rows`` (``df``: as a pandas DataFrame), the
    ``summary``, and a printable table (``print(report)``)."""

    rows: list
    title: str = "mla.validate"

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)

    @property
    def df(self):
        import pandas as pd

        return pd.DataFrame(self.rows, columns=ROW_COLUMNS)

    @property
    def summary(self) -> dict:
        return summary(self.rows)

    def __str__(self):
        s = self.summary
        lines = [table(self.rows, self.title)]
        lines.append(f"{'PASS' if self.ok else 'FAIL'}: {s['rows']} runs, {s['failures']} failed; worst out error "
                     f"{_fmt(s['worst_out_excess'])} of its allowance, worst lse {_fmt(s['worst_lse_excess'])}; "
                     f"worst cosine diff out {_fmt(s['worst_out_cos'])} (bound {OUT_COS:g}), lse "
                     f"{_fmt(s['worst_lse_cos'])} (bound {LSE_COS:g})")
        lines += [f"  {f}" for f in s["failed"][:20]]
        return "\n".join(lines)

    __repr__ = __str__


def validate(fn, cases=None, device=None, *, progress: bool = True, leak_check: bool = True,
             name: str | None = None) -> Report:
    """Validate ``fn`` (the signature of :func:`mla.sparse_decode`) against the float64 reference
    on ``cases`` (default: :func:`odd_cases` on a GPU, :func:`quick_cases` on the CPU).
    ``fn`` may also be an impl name, a list, or a dict, as in :func:`sweep`. Returns a
    :class:`Report`: ``report.ok``, ``print(report)``, ``report.df``. Needs only torch (pandas,
    rich and tqdm are used when installed)."""
    device = torch.device(device) if device is not None else _default_device()
    if cases is None:
        cases = odd_cases() if device.type == "cuda" else quick_cases()
    impls = {name: fn} if (name and callable(fn)) else fn
    return Report(sweep_rows(impls, cases, device, progress=progress, leak_check=leak_check))


# --------------------------------------------------------------------------------------------
# Deliberately broken implementations: the harness must catch every one of them.

def _broken_decode(q, k_cache, indices, softmax_scale=None, attn_sink=None, topk_length=None,
                   extra_k_cache=None, extra_indices=None, extra_topk_length=None, *,
                   mask_scores=True, zero_masked_v=True, clamp_only=False, sink_per_split=False,
                   sink_in_lse=False, naive_empty=False, round_toward_zero=False):
    """The reference's algorithm in float32 with one mistake switched on (see :data:`BROKEN`)."""
    from .layout import D_QK, gather_tokens

    scale = D_QK ** -0.5 if softmax_scale is None else float(softmax_scale)
    kvs, valids = [], []
    for cache, ind, ln in ((k_cache, indices, topk_length), (extra_k_cache, extra_indices, extra_topk_length)):
        if cache is None:
            continue
        n = cache.shape[0] * cache.shape[1]
        valid = (ind >= 0) & (ind < n)
        if ln is not None:
            valid &= torch.arange(ind.shape[-1], device=ind.device).view(1, 1, -1) < ln.view(-1, 1, 1)
        safe = ind.long().clamp(0, n - 1)                      # every index inside the cache
        kv = gather_tokens(cache, safe).float()                # reads the clamped tokens' bytes
        if clamp_only:
            valid = torch.ones_like(valid)                     # ... and uses them as if valid
        if zero_masked_v:
            kv = torch.where(valid[..., None], kv, torch.zeros((), device=kv.device))
        kvs.append(kv)
        valids.append(valid)
    kv, valid = torch.cat(kvs, 2), torch.cat(valids, 2)
    s = torch.einsum("bshd,bstd->bsht", q.float(), kv) * scale
    if mask_scores:
        s = s.masked_fill(~valid[:, :, None, :], -math.inf)

    def softmax_part(sc, v):
        lse = torch.logsumexp(sc, -1)
        p = torch.exp(sc - lse[..., None]) if naive_empty else torch.exp(sc - torch.nan_to_num(lse, neginf=0.0)[..., None])
        return torch.einsum("bsht,bstd->bshd", p, v), lse

    sink = None if attn_sink is None else attn_sink.float().view(1, 1, -1)
    if sink_per_split:                                         # split-K, sink applied per split
        half = max(1, kv.shape[2] // 2)
        parts = [softmax_part(s[..., :half], kv[:, :, :half]), softmax_part(s[..., half:], kv[:, :, half:])]
        if sink is not None:
            parts = [(o * (1 / (1 + torch.exp(sink - lse)))[..., None], lse) for o, lse in parts]
        lse = torch.logaddexp(parts[0][1], parts[1][1])
        lse_safe = torch.nan_to_num(lse, neginf=0.0)
        out = sum(torch.nan_to_num(torch.exp(l_ - lse_safe))[..., None] * o for o, l_ in parts)
    else:
        out, lse = softmax_part(s, kv)
        if sink is not None:
            out = out * (1 / (1 + torch.exp(sink - torch.nan_to_num(lse, neginf=0.0))))[..., None]
    empty = torch.isneginf(lse) if not naive_empty else torch.zeros_like(lse, dtype=torch.bool)
    out = torch.where(empty[..., None], torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    if sink_in_lse and sink is not None:
        lse = torch.logaddexp(lse, sink)
    if round_toward_zero:                                      # bf16 by dropping the low 16 bits
        bits = out.float().contiguous().view(torch.int32) >> 16
        return bits.to(torch.int16).view(torch.bfloat16), lse.permute(0, 2, 1).contiguous()
    return out.bfloat16(), lse.permute(0, 2, 1).contiguous()


#: Broken variants of the decode, each a classic kernel mistake, with the signature of
#: :func:`mla.sparse_decode`. The harness must flag every one.
BROKEN = {
    "no mask (clamps invalid indices)": functools.partial(_broken_decode, clamp_only=True),
    "masks scores, not V (0*NaN)": functools.partial(_broken_decode, zero_masked_v=False),
    "sink before the combine": functools.partial(_broken_decode, sink_per_split=True),
    "lse includes the sink": functools.partial(_broken_decode, sink_in_lse=True),
    "no empty-query guard": functools.partial(_broken_decode, naive_empty=True),
    "bf16 rounded toward zero": functools.partial(_broken_decode, round_toward_zero=True),
}
#: The correct float32 version of the same code (so the mistakes, not the code, are caught).
CORRECT_F32 = functools.partial(_broken_decode)


__all__ = ["OUT_ABS", "OUT_REL", "LSE_ABS", "LSE_REL", "OUT_COS", "LSE_COS", "Closeness", "cosine_diff", "compare",
           "check_against_reference",
           "INVALID_KINDS", "invalid_values", "poison_unreferenced", "make_case", "poison_allocator", "run_case",
           "CaseSpec", "cases", "quick_cases", "odd_cases", "benchmark_cases", "ODD_AXES", "sweep", "sweep_rows",
           "check",
           "summary", "table", "Report", "validate", "unreferenced_invariant", "BROKEN", "CORRECT_F32",
           "ROW_COLUMNS", "graph_replay_check"]


def graph_replay_check(case: dict, replays: int = 3, impl: str = "mma", invalid_frac: float = 0.05) -> dict:
    """Capture ``mla.sparse_decode(**case, impl=impl)`` in a CUDA graph, then, before each replay,
    write fresh random latents into the captured caches and new random indices (with
    ``invalid_frac`` invalid ones) into the captured index tensors (the main cache's, and the
    extra cache's when the case has one), and check the replay against the reference. Passing
    proves the call has no host sync and reads its caches and indices at replay time. Every
    replay's reference must be finite everywhere: a NaN-poisoned cache would make NaN agree
    with NaN and the check vacuous, so such a replay counts as failed."""
    from .api import sparse_decode
    from .layout import D_QK, quantize_kv
    from .reference import sparse_decode_reference

    args = dict(case, indices=case["indices"].clone(), k_cache=case["k_cache"].clone())
    pairs = [("k_cache", "indices")]
    if case.get("extra_k_cache") is not None:
        args.update(extra_indices=case["extra_indices"].clone(), extra_k_cache=case["extra_k_cache"].clone())
        pairs.append(("extra_k_cache", "extra_indices"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sparse_decode(**args, impl=impl)          # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_decode(**args, impl=impl)
    res = []
    for seed in range(replays):
        g = torch.Generator(device="cpu").manual_seed(1000 + seed)
        n_bad = 0
        for cache_key, idx_key in pairs:
            kc, idx = args[cache_key], args[idx_key]
            nblk, page = kc.shape[0], kc.shape[1]
            kinds = torch.tensor(invalid_values(nblk * page), dtype=torch.int32)
            kc.copy_(quantize_kv(torch.randn(nblk, page, D_QK, generator=g).bfloat16()))
            new = torch.randint(0, nblk * page, idx.shape, dtype=torch.int32, generator=g)
            bad = torch.rand(idx.shape, generator=g) < invalid_frac
            idx.copy_(torch.where(bad, kinds[torch.randint(0, len(kinds), idx.shape, generator=g)], new))
            n_bad += int(bad.sum())
        graph.replay()
        torch.cuda.synchronize()
        ref = sparse_decode_reference(**args, out_dtype=torch.float64)   # it reads the inputs, never writes them
        finite = bool(torch.isfinite(ref[0]).all())
        co, cl = check_against_reference(out, lse, *ref)
        res.append({"replay": seed, "ok": co.ok and cl.ok and finite, "reference_finite": finite,
                    "invalid_indices": n_bad, "out": str(co), "lse": str(cl)})
    return {"ok": all(r["ok"] for r in res), "replays": res}
