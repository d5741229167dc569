"""Autotuning without the pitfalls: the helpers ``mla`` uses, and the small kernels that
Chapter 4 ("Autotuner pitfalls") demonstrates them with.

``@triton.autotune`` returns an ``Autotuner`` object, not a function, and several of its
behaviours surprise a kernel engineer the first time. What this module does about each:

- :func:`kernel_name` names a kernel through any stack of wrappers (``Autotuner``,
  ``Heuristics``, ``JITFunction``, the interpreter's ``InterpretedFunction``,
  ``functools.partial``); an ``Autotuner`` has no ``__name__``.
- :func:`tuned_configs` reads the choice per tuning key (``Autotuner.best_config`` exists only
  after the first call and then holds the *last* call's choice).
- :func:`bucket` rounds a size up to a power of two, for an autotune key that does not retune at
  every new batch size.
- :func:`prune_by_shared_memory` / :func:`shared_memory_pruner` drop configs that do not fit an
  architecture's shared memory, with the ahead-of-time compile of :mod:`mla.aot`, before anything
  is benchmarked.
- :func:`autotune_configs` keeps one config under Triton's CPU interpreter, which cannot
  benchmark several ("0 active drivers").
- :func:`warmup_keys` and :func:`autotune_guard`: tune every key before a CUDA graph is
  captured, and make tuning inside the capture an error with a clear message.

``mla``'s own decode kernels do not autotune at all: they read shipped configs (see
:mod:`mla.configs`), so a serving call never benchmarks.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import json
import logging
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from . import _runtime

log = logging.getLogger("mla")

# --------------------------------------------------------------------------------------------
# Naming a kernel through its wrappers
# --------------------------------------------------------------------------------------------


def kernel_name(obj) -> str:
    """The name of the Python function under any stack of kernel wrappers.

    Unwraps ``triton.autotune`` (``Autotuner``) and ``triton.heuristics`` (``Heuristics``),
    which keep the wrapped object in ``.fn`` and have no ``__name__``; ``triton.jit``
    (``JITFunction``) and the interpreter's ``InterpretedFunction``, which keep the Python
    function in ``.fn``; ``functools.partial`` (``.func``), bound methods (``__func__``, or the
    kernel for a method of a kernel object such as ``autotuner.run``) and ``functools.wraps``
    (``__wrapped__``). Anything else: its ``__name__``, else its type's name.
    """
    cur = obj
    for _ in range(32):                      # deep enough for any real stack; stops a cycle
        if inspect.isfunction(cur) or inspect.isbuiltin(cur):
            return cur.__name__
        if inspect.ismethod(cur) and hasattr(cur.__self__, "fn"):   # e.g. autotuner.run: the kernel
            cur = cur.__self__
            continue
        nxt = None
        for attr in ("fn", "func", "__func__", "__wrapped__"):
            nxt = getattr(cur, attr, None)
            if nxt is not None and nxt is not cur:
                break
            nxt = None
        if nxt is None:
            break
        cur = nxt
    name = getattr(cur, "__name__", None)
    return name if isinstance(name, str) else type(cur).__name__


def find_autotuner(obj):
    """The ``Autotuner`` in a stack of wrappers, or None."""
    from triton.runtime.autotuner import Autotuner

    seen = set()
    cur = obj
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, Autotuner):
            return cur
        seen.add(id(cur))
        cur = getattr(cur, "fn", None) or getattr(cur, "func", None)
    return None


def tuned_configs(kernel) -> dict:
    """``{tuning key: config}`` for every key an autotuned kernel has tuned so far.

    Prefer this to ``kernel.best_config``, which is unset before the first call and afterwards
    holds whichever config the *last* call used, whatever its key. A tuning key is the tuple of
    the ``key=`` arguments' values followed by the dtypes of the tensor arguments. An autotuner
    with a single config never tunes: it returns ``{}``."""
    at = find_autotuner(kernel)
    if at is None:
        raise TypeError(f"{kernel_name(kernel)} is not autotuned")
    return dict(at.cache)


# --------------------------------------------------------------------------------------------
# Keys, configs, pruning
# --------------------------------------------------------------------------------------------


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """``n`` rounded up to a power of two (at least ``minimum``, at most ``maximum``): an autotune
    key argument that changes ``log2(n)`` times over a range of sizes instead of ``n`` times."""
    n = int(n)
    if n < 0:
        raise ValueError(f"bucket: n must be >= 0, got {n}")
    b = max(int(minimum), triton.next_power_of_2(max(n, 1)))
    return b if maximum is None else min(b, int(maximum))


def autotune_configs(configs: list) -> list:
    """The configs to hand ``triton.autotune``: all of them on a GPU, only the first under
    Triton's CPU interpreter. There, benchmarking several configs fails ("0 active drivers":
    the autotuner asks the GPU driver for a benchmarker), and a timing of the interpreter would
    measure numpy, not a GPU, anyway. Put the config to use on the CPU first."""
    configs = list(configs)
    if not configs:
        raise ValueError("autotune_configs: no configs")
    return configs[:1] if _runtime.single_config() else configs


def _default_variant(arch: int, cfg) -> dict:
    """The decode kernel's AOT variant for an :class:`~mla.kernels.mma.MMAConfig` or for a
    ``triton.Config`` whose kwargs name ``BLOCK_H`` / ``BLOCK_N`` (and optionally the other
    constexprs of :func:`mla.aot.mma_variant`, lower-cased)."""
    from . import aot

    if isinstance(cfg, triton.Config):
        kw = {k.lower(): v for k, v in cfg.kwargs.items()}
        return aot.mma_variant(arch, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kw)
    return aot.config_variant(arch, cfg)


_SMEM_REPORTS: dict = {}


def _current_arch() -> int:
    if not torch.cuda.is_available():
        raise ValueError("no CUDA GPU: pass arch= (e.g. 120 for sm_120)")
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def shared_memory(configs: list, arch: int | None = None, variant=None) -> list[dict]:
    """The AOT compile report (:func:`mla.aot.report`: ``shared`` bytes, ``fits``, registers,
    or ``error``) of each config for ``arch``, one compile per config not seen before in this
    process. ``variant(arch, config)`` builds the compile request; the default compiles
    ``mma_decode_kernel``."""
    from . import aot

    arch = _current_arch() if arch is None else int(arch)
    if arch not in aot.SMEM_LIMIT:
        raise ValueError(f"no shared-memory limit known for sm_{arch}; known: {sorted(aot.SMEM_LIMIT)}")
    variant = variant or _default_variant
    reqs = [variant(arch, c) for c in configs]
    keys = [json.dumps(r, sort_keys=True) for r in reqs]
    todo = {k: r for k, r in zip(keys, reqs) if k not in _SMEM_REPORTS}
    if todo:      # one child process per config, in parallel (each compile is single-threaded)
        workers = max(1, min(len(todo), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            reps = list(pool.map(lambda r: aot.report([r])[0], todo.values()))
        _SMEM_REPORTS.update(zip(todo, reps))
    return [_SMEM_REPORTS[k] for k in keys]


def prune_by_shared_memory(configs: list, arch: int | None = None, variant=None) -> list:
    """The configs that compile for ``arch`` within its shared memory per block
    (:data:`mla.aot.SMEM_LIMIT`; sm_120: 99 KB), checked by an ahead-of-time compile, so that
    no config that cannot launch is ever benchmarked or shipped. Logs each dropped config."""
    from . import aot

    arch = _current_arch() if arch is None else int(arch)
    kept = []
    for cfg, rep in zip(configs, shared_memory(configs, arch, variant)):
        if "error" in rep:
            log.info("mla: pruned %s for sm_%d: compile error %s", cfg, arch, rep["error"][:200])
        elif rep["shared"] > aot.SMEM_LIMIT[arch]:
            log.info("mla: pruned %s for sm_%d: %d bytes of shared memory > %d", cfg, arch, rep["shared"],
                     aot.SMEM_LIMIT[arch])
        else:
            kept.append(cfg)
    return kept


def shared_memory_pruner(arch: int | None = None, variant=None):
    """An ``early_config_prune`` for ``triton.autotune(prune_configs_by=...)`` doing
    :func:`prune_by_shared_memory` (each config compiled once per process)."""

    def early_config_prune(configs, named_args, **kwargs):
        kept = prune_by_shared_memory(list(configs), arch, variant)
        if not kept:
            raise ValueError(f"no config fits the shared memory of sm_{arch or _current_arch()}")
        return kept

    return early_config_prune


# --------------------------------------------------------------------------------------------
# Benchmarkers, warm-up, and a guard for regions that must not tune (CUDA-graph capture)
# --------------------------------------------------------------------------------------------


def interpreter_bench(kernel_call, quantiles=None, reps: int = 3):
    """A stand-in for Triton's GPU benchmarker on the CPU interpreter, for demonstrations: it
    calls the kernel ``reps`` times, as ``do_bench`` does many times, and returns wall-clock
    milliseconds (which measure the interpreter, not a GPU). Pass it as ``do_bench=``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        kernel_call()
        times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times)
    return [med, min(times), max(times)] if quantiles is not None else med


def default_bench():
    """Triton's benchmarker on a GPU; :func:`interpreter_bench` under the interpreter."""
    if _runtime.INTERPRET:
        return interpreter_bench
    from triton.runtime import driver

    get = getattr(driver.active, "get_benchmarker", None)
    if get is not None:
        return get()
    from triton.testing import do_bench

    return do_bench


class CountingBench:
    """A ``do_bench=`` for ``triton.autotune`` that counts the benchmark runs (one per config per
    new key) and delegates the timing to ``inner`` (default: :func:`default_bench`)."""

    def __init__(self, inner=None):
        self.inner = inner
        self.calls = 0

    def __call__(self, kernel_call, quantiles=None, **kw):
        self.calls += 1
        inner = self.inner or default_bench()
        return inner(kernel_call, quantiles=quantiles, **kw)


def warmup_keys(fn, key_values) -> list:
    """Call ``fn(v)`` for every key value ``v`` (for example every batch-size bucket a serving
    loop will capture), so that each autotuned kernel it launches has tuned that key before a
    CUDA graph is captured; then wait for the GPU. Returns the values warmed up."""
    done = []
    for v in key_values:
        fn(v)
        done.append(v)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return done


class AutotuneInRegion(RuntimeError):
    """An autotuner tried to benchmark inside :func:`autotune_guard`."""


@contextlib.contextmanager
def autotune_guard(what: str = "this region"):
    """Inside the block, any ``triton.autotune`` kernel that meets a new key raises
    :class:`AutotuneInRegion` naming the kernel, instead of benchmarking (which inside a CUDA-graph
    capture synchronizes the device and breaks the capture, or gets captured). Wrap graph capture
    in it after :func:`warmup_keys`. Patches ``Autotuner._bench`` for the duration (every
    autotuner in the process; not thread-safe)."""
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.__dict__["_bench"]

    def refuse(self, *args, config, **meta):
        raise AutotuneInRegion(f"{kernel_name(self)} would autotune (config {config}) inside {what}: "
                               "warm every key up first (mla.tuning.warmup_keys)")

    Autotuner._bench = refuse
    try:
        yield
    finally:
        Autotuner._bench = original


# --------------------------------------------------------------------------------------------
# Demonstration kernels (Chapter 4). Tiny, so that the CPU interpreter runs them in seconds.
# --------------------------------------------------------------------------------------------


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
