"""Validation cases: fresh random inputs with every kind of invalid index and NaN in every cache
byte that must not be read, and the case sets (quick, odd shapes, the benchmark's shapes)."""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, fields

import torch

from ..bench import random_cache, spec_shapes
from ..layout import V32, cache_layout, layout_for_head_dim, page_stride, quantize_kv

INVALID_KINDS = ("-1", "int32 min", "int32 max", "just past the end")


def invalid_values(n_tokens: int) -> list[int]:
    """One index of each invalid kind for a cache of ``n_tokens`` tokens."""
    return [-1, -2 ** 31, 2 ** 31 - 1, n_tokens]


def cache_span(cache: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a cache's bytes from its first page to the end of its last page's
    stride padding, or of its storage where that ends first: a one-page cache moved with
    ``.to(device)`` keeps its page stride but not the padding after its tokens."""
    u8 = cache.view(torch.uint8)
    room = u8.untyped_storage().nbytes() - u8.storage_offset()
    return torch.as_strided(u8, (min(cache.shape[0] * cache.stride(0), room),), (1,))


def _fill_unreferenced(cache: torch.Tensor, used: torch.Tensor, nope: int, rope: int, scale: int, pad: int) -> None:
    L = cache_layout(cache)
    nb, p = cache.shape[0], cache.shape[1]
    ps = cache.stride(0)
    span = cache_span(cache)
    width = ps if span.numel() == nb * ps else p * L.token_bytes      # the last page's padding may be absent
    flat = torch.as_strided(span, (nb, width), (ps, 1))
    keep = torch.zeros(nb * p, dtype=torch.bool, device=cache.device)
    u = used.reshape(-1).long()
    keep[u[(u >= 0) & (u < nb * p)]] = True
    drop = ~keep.view(nb, p)[..., None]
    rows = flat[:, : p * L.row_bytes].view(nb, p, L.row_bytes)
    if L.scale_rows_apart:
        scales = flat[:, p * L.row_bytes: p * L.token_bytes].view(nb, p, L.scale_row_bytes)
    else:
        scales = rows[..., L.scales_at: L.scales_at + L.scale_row_bytes]
    rows[..., :L.d_nope].masked_fill_(drop, nope)
    rows[..., L.rope_at: L.rope_at + 2 * L.d_rope].masked_fill_(drop, rope)
    scales.masked_fill_(drop, scale)
    if width > p * L.token_bytes:
        flat[:, p * L.token_bytes:] = pad


def poison_unreferenced(cache: torch.Tensor, used: torch.Tensor) -> None:
    """Fill, in place, every byte of ``cache`` that no index in ``used`` refers to with NaN bytes:
    0x7F (e4m3 NaN) in nope, 0xFF in rope (bf16 NaN) and in the scales (UE8M0 and float32 NaN),
    and 0x7F in the stride padding (V3.2's: a page's spare token). Indices outside the cache are
    ignored. A kernel that reads, or multiplies by zero, any byte it must not use, then produces
    NaN."""
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
              extra_num_blocks=None, sink_inf=True, softmax_scale=None, q_scale=1.0, strided=False,
              d_qk=512) -> dict:
    """Fresh random inputs for one call: q, caches of quantized N(0, 1) latents (``d_qk`` 512:
    MODEL1 caches; 576: V3.2's, :func:`mla.layout.layout_for_head_dim`), indices with
    ``invalid_frac`` of every invalid kind, optional lengths (one of them 0), a sink with +inf
    and -inf entries (``sink_inf``; else all finite), and every unreferenced cache byte NaN.
    ``empty_query`` leaves query (0, 0) with no valid token in either cache. ``q_scale``
    multiplies q (large scores: a peaked softmax). ``lengths="edges"`` gives every other batch
    row a length of 0 and the rest the full top-k. ``strided`` hands q and the indices over as
    views with s_q outermost in memory, as FlashMLA's tests make them. Returns the keyword arguments of
    :func:`mla.sparse_decode` (without ``impl``). Caches of more than 2**18 tokens for a CUDA
    device are generated on the device."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    device = torch.device(device)
    layout = layout_for_head_dim(d_qk, "d_qk")

    def cache_and_indices(k, pg, nblk):
        nblk = nblk or max(2, -(-b * s_q * k // pg) + 1)
        n = nblk * pg
        if device.type == "cuda" and n > _DEVICE_GEN_TOKENS:
            gd = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=g)))
            cache = random_cache(nblk, pg, device, gd, layout=layout)
        else:
            cache = quantize_kv(torch.randn(nblk, pg, d_qk, generator=g).bfloat16()).to(device)
        idx = torch.randint(0, n, (b, s_q, k), generator=g, dtype=torch.int32)
        bad = torch.rand(b, s_q, k, generator=g) < invalid_frac
        kinds = torch.tensor(invalid_values(n), dtype=torch.int32)
        idx = torch.where(bad, kinds[torch.randint(0, len(kinds), (b, s_q, k), generator=g)], idx)
        if empty_query:
            idx[0, 0, :] = kinds[torch.arange(k) % len(kinds)]
        return cache, idx.to(device)

    kw = {}
    kw["k_cache"], kw["indices"] = cache_and_indices(topk, page, num_blocks)
    q = torch.randn(b, s_q, h_q, d_qk, generator=g)
    kw["q"] = (q * q_scale if q_scale != 1.0 else q).bfloat16().to(device)
    if sink:
        s = torch.randn(h_q, generator=g)
        if sink_inf:
            s[0] = float("inf")
            if h_q > 1:
                s[1] = float("-inf")
        kw["attn_sink"] = s.to(device)
    def draw_lengths(k):
        if lengths == "edges":
            return torch.where(torch.arange(b) % 2 == 0, k, 0).to(torch.int32)
        return torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)

    if lengths:
        tl_ = draw_lengths(topk)
        tl_[-1] = 0
        kw["topk_length"] = tl_.to(device)
    if extra_topk:
        kw["extra_k_cache"], kw["extra_indices"] = cache_and_indices(extra_topk, extra_page, extra_num_blocks)
        if lengths:
            kw["extra_topk_length"] = draw_lengths(extra_topk).to(device)
        poison_unreferenced(kw["extra_k_cache"], _valid_positions(kw["extra_indices"], kw.get("extra_topk_length")))
    poison_unreferenced(kw["k_cache"], _valid_positions(kw["indices"], kw.get("topk_length")))
    if softmax_scale is not None:
        kw["softmax_scale"] = float(softmax_scale)
    if strided:
        for key in ("q", "indices", "extra_indices"):
            if key in kw:
                kw[key] = kw[key].transpose(0, 1).contiguous().transpose(0, 1)
    return kw


def poison_allocator(nbytes: int, device) -> None:
    """Hand the caching allocator a NaN-filled block, so that the next ``torch.empty`` of about
    that size (a kernel's output) starts as NaN rather than as stale, plausible numbers."""
    t = torch.full((max(1, nbytes // 4),), float("nan"), device=device)
    del t


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
    lengths: bool | str = False
    sink: bool = True
    sink_inf: bool = True
    invalid_frac: float = 0.1
    empty_query: bool = False
    softmax_scale: float | None = None
    q_scale: float = 1.0
    seed: int = 0
    strided: bool = False
    d_qk: int = 512          #: 512: MODEL1 caches; 576: DeepSeek-V3.2's

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


def schedule_cases() -> list[CaseSpec]:
    """Production-sized cases for the flat work list (:mod:`mla.schedule`): odd batch sizes,
    shares that end mid-query (few queries of many tiles), lengths of 0 and of the full top-k,
    every index invalid, both caches at page size 2, 128 heads, and strided inputs."""
    csa = dict(topk=128, page=256, extra_topk=512, extra_page=64)
    return [
        CaseSpec("sched b3 DSA (shares end mid-query)", b=3, s_q=1, h_q=64, topk=2048, page=64, seed=500),
        CaseSpec("sched b1 h128 long (one query over every SM)", b=1, s_q=1, h_q=128, topk=16384, page=64,
                 seed=501),
        CaseSpec("sched b74 s_q2 CSA", b=74, s_q=2, h_q=64, **csa, seed=502),
        CaseSpec("sched b148 h128 HCA lengths", b=148, s_q=1, h_q=128, topk=128, page=256, extra_topk=1024,
                 extra_page=2, lengths=True, seed=503),
        CaseSpec("sched b257 lengths 0 and full", b=257, s_q=1, h_q=64, topk=512, page=64, lengths="edges",
                 seed=504),
        CaseSpec("sched b148 all invalid", b=148, s_q=1, h_q=64, topk=256, page=64, invalid_frac=1.0, seed=505),
        CaseSpec("sched both caches P2 s_q2 lengths", b=9, s_q=2, h_q=64, topk=128, page=2, extra_topk=256,
                 extra_page=2, lengths=True, empty_query=True, seed=506),
        CaseSpec("sched b5 s_q2 h128 strided q and indices", b=5, s_q=2, h_q=128, **csa, lengths=True,
                 strided=True, seed=507),
        CaseSpec("sched b33 s_q2 h16 CSA", b=33, s_q=2, h_q=16, **csa, seed=508),
    ]


def v32_cases(pool_bytes: float = 5e8) -> list[CaseSpec]:
    """DeepSeek-V3.2's cache (q 576 wide, 656-byte tokens) at the shapes of FlashMLA's V3.2
    cases: 64 and 128 heads, top-k 2048 at page size 64, b 1 to 64, s_q 1 and 2, over a pool of
    about ``pool_bytes``, 5% of the indices invalid; and what FlashMLA's sm_90 V3.2 kernel does
    not take but mla does: lengths (0 and the full top-k among them), an extra cache, strided
    inputs. The Gluon kernel does not read this layout: its forced impls skip these cases."""
    v32 = dict(topk=2048, page=64, num_blocks=max(2, int(pool_bytes // page_stride(64, V32))),
               invalid_frac=0.05, d_qk=V32.d_qk)
    out = []
    for h_q in (64, 128):
        for b, s_q in ((1, 1), (8, 2), (33, 1), (64, 2)):
            out.append(CaseSpec(f"V3.2 b{b} s_q{s_q} h{h_q}", b=b, s_q=s_q, h_q=h_q, **v32, seed=600 + len(out)))
    out += [
        CaseSpec("V3.2 b16 s_q2 h64 lengths, extra cache P2", b=16, s_q=2, h_q=64, **v32, extra_topk=256,
                 extra_page=2, lengths="edges", seed=620),
        CaseSpec("V3.2 b5 s_q2 h128 lengths, strided, an empty query", b=5, s_q=2, h_q=128, **v32, lengths=True,
                 strided=True, empty_query=True, seed=621),
    ]
    return out


def benchmark_cases(pool_bytes: float = 5e8) -> list[CaseSpec]:
    """The SPEC's benchmark shapes (:func:`mla.bench.spec_shapes`) over a main pool of about
    ``pool_bytes`` (the extra cache gets half), random indices, 5% of them invalid."""
    out = []
    for i, s in enumerate(spec_shapes()):
        nb = max(2, int(pool_bytes // page_stride(s.page)))
        enb = max(2, int(pool_bytes // 2 // page_stride(s.extra_page))) if s.extra_topk else None
        out.append(CaseSpec(f"{s.name} b{s.b}", b=s.b, s_q=s.s_q, h_q=s.h_q, topk=s.topk, page=s.page,
                            num_blocks=nb, extra_topk=s.extra_topk, extra_page=s.extra_page, extra_num_blocks=enb,
                            invalid_frac=0.05, seed=300 + i))
    return out
