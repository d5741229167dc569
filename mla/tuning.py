"""Autotuning without the pitfalls: the helpers that the autotuner chapter demonstrates (with
the small kernels of ``experiments/autotune_demos.py``).

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
from triton.runtime.autotuner import Autotuner

from . import _runtime, aot

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
    """The decode kernel's AOT variant for a :class:`~mla.configs.TlDotConfig` or for a
    ``triton.Config`` whose kwargs name ``BLOCK_H`` / ``BLOCK_N`` (and optionally the other
    arguments of :func:`mla.aot.tl_dot_variant`, lower-cased)."""
    if isinstance(cfg, triton.Config):
        kw = {k.lower(): v for k, v in cfg.kwargs.items()}
        return aot.tl_dot_variant(arch, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kw)
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
    ``tl_dot_decode_kernel``."""
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
    get = getattr(triton.runtime.driver.active, "get_benchmarker", None)
    return get() if get is not None else triton.testing.do_bench


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
    original = Autotuner.__dict__["_bench"]

    def refuse(self, *args, config, **meta):
        raise AutotuneInRegion(f"{kernel_name(self)} would autotune (config {config}) inside {what}: "
                               "warm every key up first (mla.tuning.warmup_keys)")

    Autotuner._bench = refuse
    try:
        yield
    finally:
        Autotuner._bench = original
