"""Sparse prefill (FlashMLA's ``flash_mla_sparse_fwd``) in Triton: one program per (query token,
block of BLOCK_H heads).

Each program gathers a tile of BLOCK_N bf16 tokens of ``kv`` ONCE for all BLOCK_H heads of its
block and computes S = Q.K^T and O += P.V with ``tl.dot``, heads as M, under an online softmax in
the exp2 domain. The 512 output columns are held as two accumulator halves of 256, as the
decode's :mod:`mla.kernels.tl_dot` does; a 576-wide K (DeepSeek-V3.2, whose V is the first 512
columns) is read as those two halves plus a 64-column tail that only Q.K^T uses, so that no
column is padded and one kernel serves d_qk 512 and 576 (``D_QK``, a constexpr). The grid is
(s_q, head blocks): s_q on axis 0, whose limit is 2**31 - 1, not 65535 (FlashMLA's 70000-token
case); head blocks on axis 1.

The arithmetic of FlashMLA's performance cases (every position valid; one gather per program):

- V3.2: s_q 4096, h_q 128, topk 2048, d_qk 576. FLOPs 2*s_q*h_q*topk*(576 + 512) = 2.34e12.
  Bytes: the gathered rows 4096*2048*1152 = 9.66e9 per head block, q and out 4096*128*(576 +
  512)*2 = 1.14e9. Per gathered token 2*64*1088 = 139 kFLOP for its 1152 bytes, 121 FLOP/byte at
  BLOCK_H 64 (242 for all 128 heads): under an H100's ridge (about 990 TFLOP/s over 3.35 TB/s,
  295 FLOP/byte) if every gather went to DRAM; but the kv it gathers from is s_kv*1152 bytes (9
  to 151 MB over FlashMLA's s_kv 8192-131072), a token is gathered by many queries, and the
  second head block reads what the first just read, so most of it comes from L2 and the kernel
  is bound by the tensor cores: 2.34e12 FLOP is 2.4 ms at 990 TFLOP/s.
- MODEL1: s_q 4096, h_q 64, topk 512, d_qk 512. FLOPs 2*4096*64*512*1024 = 2.75e11 (0.28 ms at
  990 TFLOP/s); bytes 4096*512*1024 = 2.15e9 gathered plus 4096*64*1024*2 = 0.54e9 for q and
  out, 2.7e9 (0.8 ms at 3.35 TB/s from DRAM): 128 FLOP/byte gathered, so this one is bound by
  the gather, and by L2's bandwidth more than DRAM's (s_kv*1024 bytes is 8-67 MB).

The tiles follow from it: heads as M with BLOCK_H 64 (a warpgroup's M; 128 heads are two
programs per token, each gathering the same rows, the second mostly from L2), BLOCK_N 64 tokens
(S is [64, 64] fp32, 16 registers a thread at 8 warps), and the fp32 output as two [64, 256]
halves, 128 registers a thread at 8 warps: all 512 columns in one program, since a program per
half would repeat Q.K^T, 53% of the FLOPs at d_qk 576. Q is [64, 576] 16-bit values, 72 KB,
loaded once; so is a K tile. The other architectures' tiles follow from their compiles
(:data:`mla.configs.PREFILL`).

The dots' operands are fp16 on the GPU by default, as the decode's: P is rounded to 2**-11 of
itself, and the output, a P-weighted mean of V rows, is then off by at most 2**-11 of the mean of
|V| (bf16 P: 2**-8), with the row sum l in fp32, unrounded. FlashMLA's prefill tolerance (abs
8e-4 or rel 3.01/128, cosine difference 7e-6) holds for bf16 P on FlashMLA's test data (|V|
about 0.08), which is why its sm_90 kernel may round P to bf16, but not on unit-variance data (a
latent after its RMSNorm), where a few valid tokens of similar score put errors of up to 2**-8
|V| on outputs near 0: ``experiments/prefill_p_rounding.py``, which models the kernel's rounding tile by
tile, finds 1174 of 2,048,000 outputs past the tolerance with bf16 P and none with fp16
(``results/cpu/prefill_p_rounding.json``). q and kv are bf16, so they are converted to fp16 as
they are loaded (exactly inside fp16's normal range: 8 significant bits fit in 11), which
limits them to |x| < 65504, as the decode's operands are. ``mla.configs.PrefillConfig(dot="bfloat16")`` keeps
them bf16 (FlashMLA's rounding, no range limit, no conversion). Under the interpreter the
operands are float32, whose ``tl.dot`` multiplies bf16 and fp16 bit patterns as integers
(triton-lang/triton#11584).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _runtime
from .common import DIM, LN2, finish_softmax, sink_factor, softmax_step, to_bf16

HALF = tl.constexpr(DIM // 2)      #: 256: the columns of one accumulator half (and of one K half)
TAIL = tl.constexpr(64)            #: the columns of a 576-wide K past the 512 of V (V3.2's rope)
#: the head dims the kernel serves: DeepSeek-V4 (V is all 512) and V3.2 (V is the first 512)
D_QKS = (512, 576)


def operand_dtype(dot: str):
    """The dots' operand type for a config's ``dot`` ("float16" or "bfloat16"): that type on a
    GPU, float32 under the interpreter (see the module docstring)."""
    return tl.float32 if _runtime.INTERPRET else getattr(tl, dot)


@triton.jit
def _load_rows(row_ptr, mask, D_QK: tl.constexpr, DOT: tl.constexpr):
    """Rows of a bf16 matrix (``row_ptr``: each row's first element; ``mask``: the rows to read,
    zeros elsewhere) as (columns 0-255, 256-511, and 512-575 when ``D_QK`` is 576), in ``DOT``."""
    c = tl.arange(0, HALF)
    a = tl.load(row_ptr[:, None] + c[None, :], mask=mask[:, None], other=0.0).to(DOT)
    b = tl.load(row_ptr[:, None] + HALF + c[None, :], mask=mask[:, None], other=0.0).to(DOT)
    if D_QK > DIM:
        r = tl.arange(0, TAIL)
        t = tl.load(row_ptr[:, None] + DIM + r[None, :], mask=mask[:, None], other=0.0).to(DOT)
    else:
        t = tl.zeros([1, 1], DOT)       # unused: no columns past 512
    return a, b, t


@triton.jit
def sparse_prefill_kernel(
    q_ptr, q_ss, q_sh, kv_ptr, kv_ss, idx_ptr, idx_ss, len_ptr, len_stride, sink_ptr, sink_stride,
    out_ptr, out_ss, out_sh, max_ptr, lse_ptr, s_kv, topk, h_q, sm_scale_log2,
    D_QK: tl.constexpr, HAS_SINK: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT: tl.constexpr,
):
    """Program (query token ``s``, head block ``hb``): the softmax over the token's valid
    positions (index in ``[0, s_kv)``, position before ``topk_length[s]``), its output (sink
    applied, bf16), and the max logit and lse (natural log, without the sink) of each head."""
    s = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h_q
    q0, q1, q2 = _load_rows(q_ptr + s * q_ss + heads.to(tl.int64) * q_sh, hmask, D_QK, DOT)
    n = topk
    if HAS_LEN:
        n = tl.minimum(topk, tl.maximum(tl.load(len_ptr + s * len_stride), 0))
    idx_row = idx_ptr + s * idx_ss
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)
    for t in range(0, tl.cdiv(n, BLOCK_N)):
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + pos, mask=pos < n, other=-1)          # past the length: -1, invalid
        valid = (idx >= 0) & (idx < s_kv)
        k0, k1, k2 = _load_rows(kv_ptr + tl.where(valid, idx, 0).to(tl.int64) * kv_ss, valid, D_QK, DOT)
        qk = tl.dot(q0, tl.trans(k0))
        qk = tl.dot(q1, tl.trans(k1), qk)
        if D_QK > DIM:
            qk = tl.dot(q2, tl.trans(k2), qk)
        p, alpha, m_i, l_i = softmax_step(qk, valid, m_i, l_i, sm_scale_log2, 1)
        pd = p.to(DOT)
        acc0 = tl.dot(pd, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pd, k1, acc1 * alpha[:, None])
    empty, l_safe, lse2 = finish_softmax(l_i, m_i)
    lse = lse2 * LN2
    f = 1.0 / l_safe                    # a head with no valid position has an exact 0 accumulator
    if HAS_SINK:
        f = f * sink_factor(tl.load(sink_ptr + heads * sink_stride, mask=hmask, other=0.0), lse, empty)
    c = tl.arange(0, HALF)
    orow = out_ptr + s * out_ss + heads.to(tl.int64) * out_sh
    tl.store(orow[:, None] + c[None, :], to_bf16(acc0 * f[:, None]), mask=hmask[:, None])
    tl.store(orow[:, None] + HALF + c[None, :], to_bf16(acc1 * f[:, None]), mask=hmask[:, None])
    row = s * h_q + heads
    tl.store(max_ptr + row, tl.where(empty, float("-inf"), m_i * LN2), mask=hmask)
    tl.store(lse_ptr + row, tl.where(empty, float("inf"), lse), mask=hmask)


def launch_params(s_q: int, h_q: int, d_qk: int, *, block_h: int, block_n: int, num_warps: int, num_stages: int,
                  dot) -> tuple:
    """(grid, constexpr and launch keywords) of the kernel, besides HAS_SINK and HAS_LEN: query
    tokens on grid axis 0 (up to 2**31 - 1 of them), head blocks on axis 1."""
    grid = (s_q, triton.cdiv(h_q, block_h))
    return grid, dict(D_QK=d_qk, BLOCK_H=block_h, BLOCK_N=block_n, DOT=dot, num_warps=num_warps,
                      num_stages=num_stages)
