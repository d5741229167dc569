"""The small kernels that the autotuner chapter demonstrates its pitfalls with: an elementwise
scale with a bucketed key, and a split-K row sum whose workspace must be zeroed between
benchmark runs. Tiny, so that the CPU interpreter runs them in seconds."""
from __future__ import annotations

from mla.tuning import autotune_configs, bucket  # first: on a machine with no GPU mla turns Triton's interpreter on
import torch
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, n_key, BLOCK: tl.constexpr):
    """y = 2 x over n elements. ``n_key`` is not read by the body: it is there to be an autotune
    key (a bucketed n) instead of n itself."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0, mask=mask)


SCALE_CONFIGS = [triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 256}, num_warps=4)]


def make_scale(key=("n_key",), configs=None, do_bench=None, prune=None, restore_value=None):
    """A fresh autotuned :func:`scale_kernel` (its own, empty, tuning cache) keyed on ``key``.
    ``restore_value``: argument names the autotuner saves before and restores after every
    benchmark run (``["y_ptr"]`` for the in-place launch :func:`scale_`)."""
    return triton.autotune(configs=list(configs or autotune_configs(SCALE_CONFIGS)), key=list(key),
                           do_bench=do_bench, restore_value=list(restore_value) if restore_value else None,
                           prune_configs_by={"early_config_prune": prune} if prune else None)(scale_kernel)


def scale(kernel, x: torch.Tensor) -> torch.Tensor:
    """Launch an autotuned :func:`scale_kernel`: y = 2 x, key argument ``n_key = bucket(n)``."""
    y = torch.empty_like(x)
    n = x.numel()
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, bucket(n))
    return y


def scale_(kernel, x: torch.Tensor) -> torch.Tensor:
    """The in-place launch: x *= 2 (``x`` is both the input and the output)."""
    n = x.numel()
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, x, n, bucket(n))
    return x


def block_for_n(configs, named_args, **kwargs):
    """An ``early_config_prune`` that keeps one config per size: the smallest BLOCK that covers n
    in one program (else the largest). The choice then differs per key, deterministically."""
    n = named_args["n"]
    fits = [c for c in configs if c.kwargs["BLOCK"] >= n]
    return [min(fits, key=lambda c: c.kwargs["BLOCK"])] if fits else [max(configs, key=lambda c: c.kwargs["BLOCK"])]


@triton.jit
def splitk_sum_kernel(x_ptr, out_ptr, K, stride_m, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """Row sums, split-K: program (m, s) sums blocks s, s + SPLIT_K, ... of row m and
    ``atomic_add``s its partial into ``out[m]``. ``out`` must hold zeros before the launch: the
    kernel accumulates into it, like a split-K workspace."""
    m = tl.program_id(0)
    s = tl.program_id(1)
    acc = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(s * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        acc += tl.load(x_ptr + m * stride_m + offs, mask=offs < K, other=0.0)
    tl.atomic_add(out_ptr + m, tl.sum(acc, 0))


SPLITK_CONFIGS = [triton.Config({"BLOCK_K": 16, "SPLIT_K": s}, num_warps=1) for s in (1, 2, 4)]


def make_splitk_sum(reset_to_zero: bool = True, configs=None, do_bench=None):
    """A fresh autotuned :func:`splitk_sum_kernel`, keyed on K. With ``reset_to_zero`` the
    autotuner zeroes ``out_ptr`` before every benchmark run and after tuning; without it, every
    benchmark run adds its sums into the caller's output."""
    return triton.autotune(configs=list(configs or autotune_configs(SPLITK_CONFIGS)), key=["K"],
                           reset_to_zero=["out_ptr"] if reset_to_zero else None,
                           do_bench=do_bench)(splitk_sum_kernel)


def splitk_sum(kernel, x: torch.Tensor) -> torch.Tensor:
    """Launch an autotuned :func:`splitk_sum_kernel` on a fresh zeroed output: row sums of x."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.zeros(m, dtype=torch.float32, device=x.device)
    kernel[lambda meta: (m, meta["SPLIT_K"])](x, out, k, x.stride(0))
    return out
