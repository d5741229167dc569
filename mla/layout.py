"""The "MODEL1" FP8 paged KV-cache layout of DeepSeek-V4 (as in FlashMLA), byte for byte.

One token is 584 bytes:

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
strides are nominal. Kernels read the page stride from the tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
    return (k_cache.shape[0] - 1) * k_cache.stride(0) + k_cache.shape[1] * TOKEN_BYTES


def check_cache(k_cache, arg: str = "k_cache") -> None:
    """Raise ValueError naming ``arg`` unless ``k_cache`` is a MODEL1 cache tensor."""
    if not isinstance(k_cache, torch.Tensor):
        fail(arg, f"expected a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
        fail(arg, f"expected dtype torch.float8_e4m3fn or torch.uint8, got {k_cache.dtype}")
    if k_cache.dim() != 4:
        fail(arg, f"expected rank 4 [num_blocks, P, 1, {TOKEN_BYTES}], got rank {k_cache.dim()}")
    nb, p, hk, nbytes = k_cache.shape
    if hk != 1 or nbytes != TOKEN_BYTES or nb < 1 or p < 1:
        fail(arg, f"expected shape [num_blocks >= 1, P >= 1, 1, {TOKEN_BYTES}], got {tuple(k_cache.shape)}")
    if k_cache.stride(3) != 1:
        fail(arg, f"the last dim must be contiguous (stride 1), got stride {k_cache.stride(3)}")
    if nb > 1 and k_cache.stride(0) < p * TOKEN_BYTES:
        fail(arg, f"page stride too small: stride(0) = {k_cache.stride(0)} bytes < P*{TOKEN_BYTES} = {p * TOKEN_BYTES}")
    if k_cache.storage_offset() + span_bytes(k_cache) > k_cache.untyped_storage().nbytes():
        fail(arg, PAST_STORAGE)


def page_stride(page_size: int) -> int:
    """Bytes from one page to the next: ``P*584`` rounded up to a multiple of 576."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return -(-page_size * TOKEN_BYTES // DATA_BYTES) * DATA_BYTES


@dataclass(frozen=True)
class Region:
    """A named byte range ``[start, end)``."""

    name: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def token_regions() -> list[Region]:
    """The 584 bytes of one token, as if its data row and scale row were laid end to end."""
    regs = [Region(f"nope tile {t}", t * TILE, (t + 1) * TILE) for t in range(N_TILES)]
    regs.append(Region("rope (bf16)", NOPE_BYTES, DATA_BYTES))
    regs += [Region(f"scale {t}", DATA_BYTES + t, DATA_BYTES + t + 1) for t in range(N_TILES)]
    regs.append(Region("pad", DATA_BYTES + N_TILES, TOKEN_BYTES))
    return regs


def page_regions(page_size: int) -> list[Region]:
    """The byte regions of one page: data rows, scale rows and the stride padding."""
    p = page_size
    regs = [Region("data rows", 0, p * DATA_BYTES),
            Region("scale rows", p * DATA_BYTES, p * TOKEN_BYTES)]
    if page_stride(p) > p * TOKEN_BYTES:
        regs.append(Region("stride padding", p * TOKEN_BYTES, page_stride(p)))
    return regs


def token_offsets(page_size: int, offset: int) -> dict[str, int]:
    """Byte offsets, from the start of its page, of token ``offset``'s data and scale rows."""
    if not 0 <= offset < page_size:
        raise ValueError(f"offset must be in [0, {page_size}), got {offset}")
    data = offset * DATA_BYTES
    return {"nope": data, "rope": data + NOPE_BYTES,
            "scales": page_size * DATA_BYTES + offset * SCALE_BYTES}


def empty_cache(num_blocks: int, page_size: int, device=None, fill: int | None = None) -> torch.Tensor:
    """An uninitialised (or ``fill``-byte filled) cache tensor with the MODEL1 strides."""
    ps = page_stride(page_size)
    buf = torch.empty(num_blocks * ps, dtype=torch.uint8, device=device)
    if fill is not None:
        buf.fill_(fill)
    cache = buf.as_strided((num_blocks, page_size, 1, TOKEN_BYTES), (ps, TOKEN_BYTES, TOKEN_BYTES, 1))
    return cache.view(torch.float8_e4m3fn)


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-tile scale, a power of two: ``2**ceil(log2(max(amax/448, 1e-4)))`` in float32."""
    return torch.pow(2.0, torch.clamp_min(amax.float() / FP8_MAX, AMAX_FLOOR).log2().ceil())


def ue8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte -> float32 ``2**(byte-127)``."""
    return torch.exp2(byte.to(torch.int32).float() - UE8M0_BIAS)


def quantize_kv(kv: torch.Tensor) -> torch.Tensor:
    """Quantize a bf16 latent cache ``[num_blocks, P, 512]`` (or ``[num_blocks, P, 1, 512]``)
    into the MODEL1 FP8 layout. Returns ``[num_blocks, P, 1, 584]`` float8_e4m3fn with the
    padded page stride. Padding bytes are zero."""
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv: expected a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() == 4:
        if kv.shape[2] != 1:
            raise ValueError(f"kv: expected one KV head (shape[2] == 1), got shape {tuple(kv.shape)}")
        kv = kv[:, :, 0]
    if kv.dim() != 3 or kv.shape[-1] != D_QK:
        raise ValueError(f"kv: expected shape [num_blocks, P, {D_QK}], got {tuple(kv.shape)}")
    if kv.dtype != torch.bfloat16:
        raise ValueError(f"kv: expected dtype torch.bfloat16, got {kv.dtype}")
    if not bool(torch.isfinite(kv).all()):
        raise ValueError("kv: contains inf or nan, which the FP8 layout cannot represent")
    nb, p, _ = kv.shape
    x = kv.float()
    nope = x[..., :D_NOPE].reshape(nb, p, N_TILES, TILE)
    scale = ue8m0_scale(nope.abs().amax(-1))                        # [nb, p, 7]
    q8 = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    exps = (torch.log2(scale).round().to(torch.int32) + UE8M0_BIAS).to(torch.uint8)

    ps = page_stride(p)
    page = torch.zeros(nb, ps, dtype=torch.uint8, device=kv.device)
    data = page[:, : p * DATA_BYTES].view(nb, p, DATA_BYTES)
    data[..., :NOPE_BYTES] = q8.reshape(nb, p, NOPE_BYTES)
    data[..., NOPE_BYTES:] = kv[..., D_NOPE:].contiguous().view(torch.uint8)
    scales = page[:, p * DATA_BYTES : p * TOKEN_BYTES].view(nb, p, SCALE_BYTES)
    scales[..., :N_TILES] = exps
    cache = page.view(-1).as_strided((nb, p, 1, TOKEN_BYTES), (ps, TOKEN_BYTES, TOKEN_BYTES, 1))
    return cache.view(torch.float8_e4m3fn)


def cache_bytes(k_cache: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of every byte a cache tensor spans (from its first page to the end
    of its last token's scale row), honouring ``stride(0)``."""
    return torch.as_strided(k_cache.view(torch.uint8), (span_bytes(k_cache),), (1,))


def token_bytes(k_cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The 584 bytes of each token ``idx`` (any shape, each in ``[0, num_blocks*P)``): its data
    row, then its scale row, as uint8 ``[*idx.shape, 584]``. Reads only those tokens' bytes."""
    flat = cache_bytes(k_cache)
    p, ps = k_cache.shape[1], k_cache.stride(0)
    idx = idx.long()
    blk, off = idx // p, idx % p
    data_at = blk * ps + off * DATA_BYTES
    scale_at = blk * ps + p * DATA_BYTES + off * SCALE_BYTES
    ar = torch.arange(DATA_BYTES, device=idx.device)
    return torch.cat([flat[data_at[..., None] + ar], flat[scale_at[..., None] + ar[:SCALE_BYTES]]], dim=-1)


def gather_tokens(k_cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Dequantize the tokens ``idx`` (any shape, each in ``[0, num_blocks*P)``) of a cache:
    returns bf16 ``[*idx.shape, 512]``. Reads only those tokens' bytes."""
    raw = token_bytes(k_cache, idx)
    nope = raw[..., :NOPE_BYTES].view(torch.float8_e4m3fn).float()
    nope = nope.unflatten(-1, (N_TILES, TILE)) * ue8m0_decode(raw[..., DATA_BYTES:DATA_BYTES + N_TILES])[..., None]
    rope = raw[..., NOPE_BYTES:DATA_BYTES].contiguous().view(torch.bfloat16)
    return torch.cat([nope.flatten(-2).to(torch.bfloat16), rope], dim=-1)


def dequantize_kv(k_cache: torch.Tensor) -> torch.Tensor:
    """MODEL1 cache -> bf16 ``[num_blocks, P, 512]``. Exact: an FP8 value times a power of two."""
    check_cache(k_cache, "k_cache")
    nb, p = k_cache.shape[0], k_cache.shape[1]
    tokens = torch.arange(nb * p, device=k_cache.device)
    return gather_tokens(k_cache, tokens).view(nb, p, D_QK)
