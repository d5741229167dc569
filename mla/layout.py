"""The two FP8 paged KV-cache layouts of FlashMLA's sparse decode, byte for byte: DeepSeek-V4's
"MODEL1" (the book's subject) and DeepSeek-V3.2's. One :class:`CacheLayout` describes each
(:data:`MODEL1`, :data:`V32`); a cache's last dim (584 or 656) and q's head dim (512 or 576)
name its layout (:func:`cache_layout`, :func:`layout_for_head_dim`).

MODEL1: one token is 584 bytes:

=========  =======  ==============================================================
bytes      size     content
=========  =======  ==============================================================
0..447     448      nope: 448 FP8 e4m3fn values, 7 tiles of 64
448..575   128      rope: 64 bf16 values, not quantized
576..582   7        scale row: one UE8M0 byte per nope tile, value 2**(byte-127)
583        1        pad
=========  =======  ==============================================================

A page (block) of ``P`` tokens is a structure of arrays: bytes ``[0, P*576)`` hold the
tokens' 576-byte data rows (token ``i`` at ``i*576``), bytes ``[P*576, P*584)`` hold the
8-byte scale rows (token ``i`` at ``P*576 + i*8``). The page stride is ``P*584`` rounded up
to a multiple of 576. The cache tensor has shape ``[num_blocks, P, 1, 584]`` (dtype
float8_e4m3fn, uint8 accepted) and ``stride(0)`` equal to that page stride; its other
strides are nominal. Kernels read the page stride from the tensor. d_qk 512, and V is the
same 512 columns, rope included.

V3.2 (FlashMLA's ``V32_FP8Sparse``): one token is 656 bytes, an array of structures (token
``i`` at ``i*656`` of its page, so ``stride(1)`` is 656): 512 FP8 nope values (4 tiles of 128),
then the tiles' 4 float32 scales (powers of two, computed as MODEL1's), then 64 bf16 rope
values. A page is allocated as ``P + 1`` tokens' bytes, as FlashMLA's ``quantize_k_cache``
does: the page stride is ``(P+1)*656``. d_qk 576; V is the 512 nope columns only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# MODEL1's constants (the module's names predate V3.2's layout; :data:`MODEL1` holds them too)
D_NOPE = 448            #: quantized ("no position encoding") dims
D_ROPE = 64             #: rotary dims, stored as bf16
D_QK = D_NOPE + D_ROPE  #: 512, the width of q, k and v
D_V = D_QK              #: V is the same latent, rope dims included
TILE = 64               #: values per UE8M0 scale
N_TILES = D_NOPE // TILE        #: 7
NOPE_BYTES = D_NOPE             #: 448 (one FP8 byte per value)
ROPE_BYTES = 2 * D_ROPE         #: 128 (bf16)
DATA_BYTES = NOPE_BYTES + ROPE_BYTES  #: 576, one token's data row
SCALE_BYTES = N_TILES + 1       #: 8: 7 UE8M0 bytes and one pad byte
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  #: 584
FP8_MAX = 448.0                 #: largest finite e4m3fn value
AMAX_FLOOR = 1e-4               #: floor of amax/448 before the power-of-two rounding
UE8M0_BIAS = 127


def fail(arg: str, msg: str):
    """Raise the ValueError that names the bad argument, as every check of ``mla`` does."""
    raise ValueError(f"{arg}: {msg}")


#: the check's words for a cache view that reaches past its storage (:func:`check_cache`, and a
#: planned call's own check, :func:`mla.api.planned_call`)
PAST_STORAGE = "the tensor's pages reach past the end of its storage"


def span_bytes(k_cache) -> int:
    """Bytes a cache tensor spans, from its first page to the end of its last token's scale row
    (its page stride, ``stride(0)``, honoured): what a view of a pool must find in its storage."""
    return (k_cache.shape[0] - 1) * k_cache.stride(0) + k_cache.shape[1] * k_cache.shape[-1]



@dataclass(frozen=True)
class CacheLayout:
    """One FP8 cache layout: the widths, the quantization tiles and their scales, and where each
    part of a token lies. Offsets are in a token's bytes in "token order": its row, then, where
    the scale rows lie apart from the rows (MODEL1), its scale row (:func:`token_bytes` returns
    them so)."""

    name: str               #: "MODEL1" or "V3.2"
    flashmla_name: str      #: FlashMLA's ``FP8KVCacheLayout`` member (its tests' quant.py)
    d_nope: int             #: FP8 ("no position encoding") columns
    d_rope: int             #: bf16 rotary columns, not quantized
    d_v: int                #: V's columns: the first ``d_v`` of a token (rope included only in MODEL1)
    tile: int               #: values per scale
    scale_format: str       #: "ue8m0" (one byte, 2**(byte-127)) or "float32"
    token_bytes: int        #: a token's bytes, the cache's last dim
    row_bytes: int          #: bytes from one token's row to the next within a page
    scale_rows_apart: bool  #: scale rows after the page's rows (structure of arrays), else inside each row
    rope_at: int            #: the rope's offset in token order (the nope is at 0)
    scales_at: int          #: the scales' offset in token order
    scale_row_bytes: int    #: the scales' bytes, padding included

    @property
    def d_qk(self) -> int:
        """The width of q and k: 512 (MODEL1) or 576 (V3.2)."""
        return self.d_nope + self.d_rope

    @property
    def n_tiles(self) -> int:
        return self.d_nope // self.tile

    @property
    def scale_size(self) -> int:
        """Bytes of one scale: 1 (UE8M0) or 4 (float32)."""
        return 1 if self.scale_format == "ue8m0" else 4

    def page_stride(self, page_size: int) -> int:
        """Bytes from one page to the next, as FlashMLA's ``quantize_k_cache`` allocates them:
        MODEL1 ``P*584`` rounded up to a multiple of 576, V3.2 ``(P+1)*656``."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if self.scale_rows_apart:
            return -(-page_size * self.token_bytes // self.row_bytes) * self.row_bytes
        return (page_size + 1) * self.token_bytes

    def offsets(self, page_size: int, offset: int) -> dict[str, int]:
        """Byte offsets, from the start of its page, of token ``offset``'s nope, rope and scales."""
        if not 0 <= offset < page_size:
            raise ValueError(f"offset must be in [0, {page_size}), got {offset}")
        row = offset * self.row_bytes
        scales = (page_size * self.row_bytes + offset * self.scale_row_bytes if self.scale_rows_apart
                  else row + self.scales_at)
        return {"nope": row, "rope": row + self.rope_at, "scales": scales}


#: DeepSeek-V4's layout: 584-byte tokens, 7 tiles of 64 with UE8M0 scales, structure of arrays
MODEL1 = CacheLayout("MODEL1", "MODEL1_FP8Sparse", d_nope=D_NOPE, d_rope=D_ROPE, d_v=D_V, tile=TILE,
                     scale_format="ue8m0", token_bytes=TOKEN_BYTES, row_bytes=DATA_BYTES, scale_rows_apart=True,
                     rope_at=NOPE_BYTES, scales_at=DATA_BYTES, scale_row_bytes=SCALE_BYTES)
#: DeepSeek-V3.2's layout: 656-byte tokens (512 FP8, 4 float32 scales, 64 bf16), array of structures
V32 = CacheLayout("V3.2", "V32_FP8Sparse", d_nope=512, d_rope=64, d_v=512, tile=128, scale_format="float32",
                  token_bytes=656, row_bytes=656, scale_rows_apart=False, rope_at=528, scales_at=512,
                  scale_row_bytes=16)
LAYOUTS = (MODEL1, V32)
_BY_TOKEN_BYTES = {L.token_bytes: L for L in LAYOUTS}
_BY_HEAD_DIM = {L.d_qk: L for L in LAYOUTS}


def layout_for_head_dim(d: int, arg: str = "q") -> CacheLayout:
    """The layout whose q and k are ``d`` wide (512: MODEL1, 576: V3.2); ValueError naming ``arg``
    otherwise."""
    if d not in _BY_HEAD_DIM:
        fail(arg, f"expected head dim 512 (MODEL1) or 576 (V3.2), got {d}")
    return _BY_HEAD_DIM[d]


def cache_layout(k_cache, arg: str = "k_cache") -> CacheLayout:
    """The layout a cache tensor's last dim names (584: MODEL1, 656: V3.2); ValueError naming
    ``arg`` otherwise. The rest of the tensor is checked by :func:`check_cache`."""
    last = k_cache.shape[-1] if isinstance(k_cache, torch.Tensor) and k_cache.dim() else None
    if last not in _BY_TOKEN_BYTES:
        fail(arg, f"expected a last dim of 584 (MODEL1) or 656 (V3.2) bytes a token, got shape "
                  f"{tuple(k_cache.shape) if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__}")
    return _BY_TOKEN_BYTES[last]


def check_cache(k_cache, arg: str = "k_cache", layout: CacheLayout | None = None) -> CacheLayout:
    """Raise ValueError naming ``arg`` unless ``k_cache`` is a cache tensor of either layout (of
    ``layout``, when given: the one q's head dim names); returns its layout."""
    if not isinstance(k_cache, torch.Tensor):
        fail(arg, f"expected a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
        fail(arg, f"expected dtype torch.float8_e4m3fn or torch.uint8, got {k_cache.dtype}")
    want = layout.token_bytes if layout is not None else "584 or 656"
    if k_cache.dim() != 4:
        fail(arg, f"expected rank 4 [num_blocks, P, 1, {want}], got rank {k_cache.dim()}")
    nb, p, hk, nbytes = k_cache.shape
    if hk != 1 or nbytes not in _BY_TOKEN_BYTES or nb < 1 or p < 1:
        fail(arg, f"expected shape [num_blocks >= 1, P >= 1, 1, {want}], got {tuple(k_cache.shape)}")
    L = _BY_TOKEN_BYTES[nbytes]
    if layout is not None and L is not layout:
        fail(arg, f"{nbytes}-byte tokens are the {L.name} layout (head dim {L.d_qk}), but q's head dim "
                  f"{layout.d_qk} is the {layout.name} layout's ({layout.token_bytes}-byte tokens)")
    if k_cache.stride(3) != 1:
        fail(arg, f"the last dim must be contiguous (stride 1), got stride {k_cache.stride(3)}")
    if not L.scale_rows_apart:
        if p > 1 and k_cache.stride(1) != L.token_bytes:
            fail(arg, f"a {L.name} page's tokens lie {L.token_bytes} bytes apart: expected stride(1) = "
                      f"{L.token_bytes}, got {k_cache.stride(1)}")
        if (nb > 1 and k_cache.stride(0) % 4) or k_cache.data_ptr() % 4:
            fail(arg, f"the {L.name} layout's float32 scales need the page stride and the first page's address "
                      f"to be multiples of 4 bytes, got stride(0) = {k_cache.stride(0)}, address "
                      f"{k_cache.data_ptr():#x}")
    if nb > 1 and k_cache.stride(0) < p * L.token_bytes:
        fail(arg, f"page stride too small: stride(0) = {k_cache.stride(0)} bytes < P*{L.token_bytes} = "
                  f"{p * L.token_bytes}")
    if k_cache.storage_offset() + span_bytes(k_cache) > k_cache.untyped_storage().nbytes():
        fail(arg, PAST_STORAGE)
    return L


def page_stride(page_size: int, layout: CacheLayout = MODEL1) -> int:
    """Bytes from one page to the next (:meth:`CacheLayout.page_stride`): for MODEL1 ``P*584``
    rounded up to a multiple of 576."""
    return layout.page_stride(page_size)


@dataclass(frozen=True)
class Region:
    """A named byte range ``[start, end)``."""

    name: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def token_regions(layout: CacheLayout = MODEL1) -> list[Region]:
    """A token's bytes in token order (for MODEL1, as if its data row and scale row were laid
    end to end)."""
    L = layout
    tiles = [Region(f"nope tile {t}", t * L.tile, (t + 1) * L.tile) for t in range(L.n_tiles)]
    rope = Region("rope (bf16)", L.rope_at, L.rope_at + 2 * L.d_rope)
    scales = [Region(f"scale {t}", L.scales_at + t * L.scale_size, L.scales_at + (t + 1) * L.scale_size)
              for t in range(L.n_tiles)]
    pad_at = L.scales_at + L.n_tiles * L.scale_size
    pad = [Region("pad", pad_at, L.scales_at + L.scale_row_bytes)] if L.scale_row_bytes > pad_at - L.scales_at else []
    return sorted(tiles + [rope] + scales + pad, key=lambda r: r.start)


def page_regions(page_size: int, layout: CacheLayout = MODEL1) -> list[Region]:
    """The byte regions of one page: data rows and scale rows (MODEL1) or the tokens (V3.2), and
    the stride padding."""
    p, L = page_size, layout
    if L.scale_rows_apart:
        regs = [Region("data rows", 0, p * L.row_bytes), Region("scale rows", p * L.row_bytes, p * L.token_bytes)]
    else:
        regs = [Region("tokens", 0, p * L.token_bytes)]
    if L.page_stride(p) > p * L.token_bytes:
        regs.append(Region("stride padding", p * L.token_bytes, L.page_stride(p)))
    return regs


def token_offsets(page_size: int, offset: int, layout: CacheLayout = MODEL1) -> dict[str, int]:
    """Byte offsets, from the start of its page, of token ``offset``'s nope, rope and scales
    (:meth:`CacheLayout.offsets`)."""
    return layout.offsets(page_size, offset)


def empty_cache(num_blocks: int, page_size: int, device=None, fill: int | None = None,
                layout: CacheLayout = MODEL1) -> torch.Tensor:
    """An uninitialised (or ``fill``-byte filled) cache tensor with the layout's strides."""
    ps = layout.page_stride(page_size)
    buf = torch.empty(num_blocks * ps, dtype=torch.uint8, device=device)
    if fill is not None:
        buf.fill_(fill)
    tb = layout.token_bytes
    cache = buf.as_strided((num_blocks, page_size, 1, tb), (ps, tb, tb, 1))
    return cache.view(torch.float8_e4m3fn)


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-tile scale, a power of two: ``2**ceil(log2(max(amax/448, 1e-4)))`` in float32 (both
    layouts' scales: V3.2 stores it as a float32, MODEL1 as its UE8M0 exponent byte)."""
    return torch.pow(2.0, torch.clamp_min(amax.float() / FP8_MAX, AMAX_FLOOR).log2().ceil())


def ue8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte -> float32 ``2**(byte-127)``."""
    return torch.exp2(byte.to(torch.int32).float() - UE8M0_BIAS)


def quantize_kv(kv: torch.Tensor) -> torch.Tensor:
    """Quantize a bf16 latent cache ``[num_blocks, P, d]`` (or ``[num_blocks, P, 1, d]``) into
    the FP8 layout its width names: d 512 MODEL1 (``[num_blocks, P, 1, 584]``), d 576 V3.2
    (``[num_blocks, P, 1, 656]``). Returns float8_e4m3fn with the layout's page stride; every
    byte that is not a token's (pad, stride padding) is zero."""
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv: expected a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() == 4:
        if kv.shape[2] != 1:
            raise ValueError(f"kv: expected one KV head (shape[2] == 1), got shape {tuple(kv.shape)}")
        kv = kv[:, :, 0]
    if kv.dim() != 3 or kv.shape[-1] not in _BY_HEAD_DIM:
        raise ValueError(f"kv: expected shape [num_blocks, P, 512] (MODEL1) or [num_blocks, P, 576] (V3.2), got "
                         f"{tuple(kv.shape)}")
    if kv.dtype != torch.bfloat16:
        raise ValueError(f"kv: expected dtype torch.bfloat16, got {kv.dtype}")
    if not bool(torch.isfinite(kv).all()):
        raise ValueError("kv: contains inf or nan, which the FP8 layout cannot represent")
    L = _BY_HEAD_DIM[kv.shape[-1]]
    nb, p, _ = kv.shape
    nope = kv[..., :L.d_nope].float().reshape(nb, p, L.n_tiles, L.tile)
    scale = ue8m0_scale(nope.abs().amax(-1))                        # [nb, p, tiles]
    q8 = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    if L.scale_format == "ue8m0":
        scale_bytes = (torch.log2(scale).round().to(torch.int32) + UE8M0_BIAS).to(torch.uint8)
    else:
        scale_bytes = scale.contiguous().view(torch.uint8)          # little-endian float32s

    ps = L.page_stride(p)
    page = torch.zeros(nb, ps, dtype=torch.uint8, device=kv.device)
    rows = page[:, : p * L.row_bytes].view(nb, p, L.row_bytes)
    rows[..., :L.d_nope] = q8.reshape(nb, p, L.d_nope)
    rows[..., L.rope_at:L.rope_at + 2 * L.d_rope] = kv[..., L.d_nope:].contiguous().view(torch.uint8)
    if L.scale_rows_apart:
        scales = page[:, p * L.row_bytes: p * L.token_bytes].view(nb, p, L.scale_row_bytes)[..., :L.n_tiles]
    else:
        scales = rows[..., L.scales_at:L.scales_at + L.n_tiles * L.scale_size]
    scales[:] = scale_bytes.reshape(nb, p, -1)
    tb = L.token_bytes
    cache = page.view(-1).as_strided((nb, p, 1, tb), (ps, tb, tb, 1))
    return cache.view(torch.float8_e4m3fn)


def cache_bytes(k_cache: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of every byte a cache tensor spans (from its first page to the end
    of its last token), honouring ``stride(0)``."""
    return torch.as_strided(k_cache.view(torch.uint8), (span_bytes(k_cache),), (1,))


def token_bytes(k_cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The bytes of each token ``idx`` (any shape, each in ``[0, num_blocks*P)``) in token order
    (MODEL1: its data row, then its scale row; V3.2: the token as stored), as uint8
    ``[*idx.shape, token bytes]``. Reads only those tokens' bytes."""
    L = cache_layout(k_cache)
    flat = cache_bytes(k_cache)
    p, ps = k_cache.shape[1], k_cache.stride(0)
    idx = idx.long()
    blk, off = idx // p, idx % p
    row_at = blk * ps + off * L.row_bytes
    ar = torch.arange(L.row_bytes, device=idx.device)
    row = flat[row_at[..., None] + ar]
    if not L.scale_rows_apart:
        return row
    scale_at = blk * ps + p * L.row_bytes + off * L.scale_row_bytes
    return torch.cat([row, flat[scale_at[..., None] + ar[:L.scale_row_bytes]]], dim=-1)


def gather_tokens(k_cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Dequantize the tokens ``idx`` (any shape, each in ``[0, num_blocks*P)``) of a cache:
    returns bf16 ``[*idx.shape, d_qk]`` (nope then rope). Reads only those tokens' bytes."""
    L = cache_layout(k_cache)
    raw = token_bytes(k_cache, idx)
    scale_raw = raw[..., L.scales_at:L.scales_at + L.n_tiles * L.scale_size]
    scale = ue8m0_decode(scale_raw) if L.scale_format == "ue8m0" else scale_raw.contiguous().view(torch.float32)
    nope = raw[..., :L.d_nope].view(torch.float8_e4m3fn).float()
    nope = nope.unflatten(-1, (L.n_tiles, L.tile)) * scale[..., None]
    rope = raw[..., L.rope_at:L.rope_at + 2 * L.d_rope].contiguous().view(torch.bfloat16)
    return torch.cat([nope.flatten(-2).to(torch.bfloat16), rope], dim=-1)


def dequantize_kv(k_cache: torch.Tensor) -> torch.Tensor:
    """Cache -> bf16 ``[num_blocks, P, d_qk]`` (512 for MODEL1, 576 for V3.2). Exact: an FP8
    value times a power of two (any float32 scale of a V3.2 cache is applied in float32, then
    rounded to bf16, as FlashMLA's ``dequantize_k_cache`` does)."""
    L = check_cache(k_cache, "k_cache")
    nb, p = k_cache.shape[0], k_cache.shape[1]
    tokens = torch.arange(nb * p, device=k_cache.device)
    return gather_tokens(k_cache, tokens).view(nb, p, L.d_qk)
