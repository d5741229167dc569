"""The launch rule: which kernel runs a call, in which form and config, with how many splits,
and the launch itself. The only module that imports both the configs and the kernels.

From the shapes and the device alone (no host sync), for ``impl="mma"``:

- on a Hopper GPU (sm_90) whose table allows it (:func:`mla.configs.gluon_enabled`), the Gluon
  kernel runs every call: heads as M where h_q > 16 and the grid fills the GPU; tokens as M
  (:func:`tokens_as_m`) where h_q <= 16 or the grid is small (:func:`small_grid`);
- anything else runs the portable ``tl.dot`` kernel with the shipped config for h_q, two
  programs per head block where the grid is small (:func:`fill_small_grid`);
- a Gluon pick whose caches it cannot copy (:func:`mla.kernels.gluon_sm90.row_align`) falls
  back to the ``tl.dot`` config;
- the split count (:func:`num_splits`) models the time from the grid and the token tiles.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import triton
from triton.compiler import CompiledKernel

from . import _runtime, configs
from .configs import GLUON_FORMS, GluonConfig, TlDotConfig
from .kernels import combine, tl_dot
from .kernels.common import LOG2E, fp8_native
from .kernels.simt import simt_sparse_decode
from .layout import D_QK

try:                       # Gluon's Hopper module: Triton 3.5 and newer
    from .kernels import gluon_sm90
except (ImportError, AttributeError):
    gluon_sm90 = None

#: the SM count assumed under the interpreter (it sizes the split count only)
INTERPRETER_SMS = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_splits(b: int, s_q: int, h_q: int, topk_total: int, block_h: int, block_n: int, dv_halves: int,
               sms: int) -> int:
    """Split-K count from the shapes alone (no host sync). Models the time as (waves of programs)
    x (token tiles per program) and takes the cheapest split, preferring fewer splits on a tie
    (each split adds partial-output traffic and, past one, the combine kernel)."""
    progs = b * s_q * _cdiv(h_q, block_h) * dv_halves
    tiles = max(1, _cdiv(topk_total, block_n))
    slots = max(1, sms)
    best, best_cost = 1, None
    for s in range(1, tiles + 1):
        cost = _cdiv(progs * s, slots) * _cdiv(tiles, s) + (0.5 if s > 1 else 0.0) + 0.01 * s
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def small_grid(cfg, b: int, s_q: int, h_q: int, topk_total: int, sms: int) -> bool:
    """Whether even one token tile per program gives fewer than half as many programs as SMs."""
    programs = b * s_q * _cdiv(h_q, cfg.block_h) * max(1, _cdiv(topk_total, cfg.block_n))
    return 2 * programs <= sms


def fill_small_grid(cfg: TlDotConfig, b: int, s_q: int, h_q: int, topk_total: int, sms: int) -> TlDotConfig:
    """The ``tl.dot`` config, adjusted for a grid too small to fill the GPU (:func:`small_grid`):
    when the head block is 64, two programs per head block (``dv_halves=2``, one warpgroup each).
    Each repeats S = Q.K^T but owns half of P.V, so twice as many SMs work on the same query. At
    larger grids the repeated Q.K^T and the 4-warp programs cost more than they gain."""
    if cfg.dv_halves != 1 or cfg.block_h != 64 or not small_grid(cfg, b, s_q, h_q, topk_total, sms):
        return cfg
    return dataclasses.replace(cfg, dv_halves=2, num_warps=4, num_stages=1)


def tokens_as_m(b: int, s_q: int, h_q: int, sms: int) -> GluonConfig:
    """The Gluon kernel's tokens-as-M form, for few heads (V4-TP8 has 8) and small grids: the
    token tile is the M of the dots and the heads are N, so 8 heads are padded to 16 or 8, not
    64, and 64 heads make four programs per query token where heads as M make one. With
    h_q <= 8 and at least half as many query tokens as SMs, 8 heads with 128-token tiles (each
    tile read once for S, the loop's fixed costs paid once per 128 tokens; its ring cannot run
    ahead of the consumers, which costs more than it saves on small grids); below that, 8 heads
    and two consumer warpgroups on alternate tiles; with more heads, 16 heads x 64 tokens."""
    if h_q <= 8:
        return GluonConfig("tokens as M, 8 x 128" if 2 * b * s_q >= sms else "tokens as M, two consumers")
    return GluonConfig("tokens as M, 16 x 64")


def choose_config(cfg: TlDotConfig, gluon: bool, b: int, s_q: int, h_q: int, topk_total: int, sms: int):
    """The launch rule on given facts, no GPU needed: ``cfg`` the shipped ``tl.dot`` config for
    h_q, ``gluon`` whether the Gluon kernel may run, ``sms`` the GPU's SM count."""
    small = small_grid(cfg, b, s_q, h_q, topk_total, sms)
    if gluon and (h_q <= 16 or small):
        return tokens_as_m(b, s_q, h_q, sms)
    if small:
        return fill_small_grid(cfg, b, s_q, h_q, topk_total, sms)
    return GluonConfig("heads as M") if gluon else cfg


def splits_for(cfg, b: int, s_q: int, h_q: int, topk_total: int, sms: int) -> int:
    """:func:`num_splits` for a config of either kernel."""
    return num_splits(b, s_q, h_q, topk_total, cfg.block_h, cfg.block_n, getattr(cfg, "dv_halves", 1), sms)


@dataclasses.dataclass(frozen=True)
class Launch:
    """What a tensor-core call launches: the config (its kernel and form), the split count, and,
    for the Gluon kernel, the width of its ring's copies (:func:`~mla.kernels.gluon_sm90.row_align`)."""

    config: TlDotConfig | GluonConfig
    splits: int
    align: int = 0
    fp8_native: bool = False

    @property
    def kernel(self) -> str:
        return self.config.kernel


@functools.lru_cache(maxsize=None)
def _device_facts(index: int):
    """(SM count, the tl.dot table, whether Gluon may run, native FP8) of a CUDA device."""
    dev = torch.device("cuda", index)
    name, tv, arch = configs.device_facts(dev)
    table = configs.table_for(name, tv, arch)[1]
    gluon = gluon_sm90 is not None and configs.gluon_for(name, tv, arch)
    return torch.cuda.get_device_properties(index).multi_processor_count, table, gluon, fp8_native(dev)


def _facts(device: torch.device):
    if _runtime.INTERPRET or device.type != "cuda":
        return INTERPRETER_SMS, None, False, False
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """The SM count the launch rule plans for (:data:`INTERPRETER_SMS` off a GPU)."""
    return _facts(device)[0]


def tl_dot_config(device: torch.device, h_q: int) -> TlDotConfig:
    """The ``tl.dot`` config this device ships for h_q (the interpreter's off a GPU), before the
    small-grid rule."""
    table = _facts(device)[1]
    return configs.INTERPRETER.for_heads(h_q) if table is None else configs.bucket_config(table, h_q)


def gluon_align(k_cache, extra_k_cache=None) -> int:
    """The Gluon kernel's copy width for these caches (0: it cannot copy them, or no Gluon)."""
    if gluon_sm90 is None:
        return 0
    caches = [(k_cache.view(torch.uint8), k_cache.stride(0))]
    if extra_k_cache is not None:
        caches.append((extra_k_cache.view(torch.uint8), extra_k_cache.stride(0)))
    return gluon_sm90.row_align(*caches)


def decide(table: dict, gluon: bool, sms: int, b: int, s_q: int, h_q: int, topk_total: int, align: int):
    """(config, splits) that the launch rule picks on given facts, no GPU needed: ``table`` the
    ``tl.dot`` table of the GPU (:func:`mla.configs.table_for`), ``gluon`` whether the Gluon
    kernel may run, ``sms`` its SM count, ``align`` the caches' :func:`gluon_align`."""
    tl_cfg = configs.bucket_config(table, h_q)
    cfg = choose_config(tl_cfg, gluon, b, s_q, h_q, topk_total, sms)
    if cfg.kernel == "gluon" and not align:     # caches the Gluon kernel cannot copy
        cfg = tl_cfg
    return cfg, splits_for(cfg, b, s_q, h_q, topk_total, sms)


def plan_launch(device: torch.device, b: int, s_q: int, h_q: int, topk: int, extra_topk: int, align: int,
                config=None, splits: int | None = None) -> Launch:
    """The launch for these shapes on ``device``; ``align`` is :func:`gluon_align` of the caches
    (0 where there is no Gluon). ``config`` and ``splits`` force a choice (tests, experiments)."""
    sms, table, gluon, native = _facts(device)
    total = topk + extra_topk
    if config is not None:
        cfg = config.for_heads(h_q)
        if cfg.kernel == "gluon":
            if gluon_sm90 is None or _runtime.INTERPRET or device.type != "cuda" \
                    or torch.cuda.get_device_capability(device) != (9, 0):
                raise ValueError("config: the Gluon kernel is for Hopper GPUs (sm_90, not the interpreter); "
                                 f"this device is {device}")
            if not align:
                raise ValueError("config: the Gluon kernel copies cache rows 8 or 16 bytes at a time: it needs "
                                 "caches whose base addresses are multiples of 16 and page strides multiples of 8")
    elif table is None:                        # the interpreter: one small config
        cfg = tl_dot_config(device, h_q)
    else:
        cfg = decide(table, gluon, sms, b, s_q, h_q, total, align)[0]
    ns = splits if splits is not None else splits_for(cfg, b, s_q, h_q, total, sms)
    return Launch(cfg, ns, align if cfg.kernel == "gluon" else 0, native)


def workspace(launch: Launch, b: int, s_q: int, h_q: int, device) -> tuple:
    """The split partials' buffers (partial outputs as fp16, lse in log2 units), or (None, None)."""
    if launch.splits <= 1:
        return None, None
    return (torch.empty(b * s_q, launch.splits, h_q, D_QK, dtype=torch.float16, device=device),
            torch.empty(b * s_q, launch.splits, h_q, dtype=torch.float32, device=device))


def _u8(cache):
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


class Launcher:
    """A launch bound to what its calls share (made once per plan): the kernel's grid and
    constexprs, the caches' page strides and sizes, the top-k widths and the scale. Called with a
    call's tensors (of those shapes), it launches the decode, and the combine when split. The
    kernels are looked up at the call, so that a stub can stand in for them."""

    def __init__(self, launch: Launch, q_shape, k_cache, topk: int, extra_k_cache, extra_topk: int, softmax_scale,
                 has_sink: bool, has_len: bool, has_elen: bool):
        b, s_q, h_q, _ = q_shape
        self.launch, self.s_q, self.h_q, self.splits = launch, s_q, h_q, launch.splits
        cfg = launch.config
        if cfg.kernel == "gluon":
            heads, tile_tokens, pair = GLUON_FORMS[cfg.form]
            self._module, self._name = gluon_sm90.kernel, "gluon_decode_kernel"
            self.grid, kw = gluon_sm90.launch_params(b * s_q, h_q, launch.splits, heads=heads, tile_tokens=tile_tokens,
                                                     two_consumers=pair, align=launch.align)
        else:
            self._module, self._name = tl_dot, "tl_dot_decode_kernel"
            self.grid, kw = tl_dot.launch_params(b * s_q, h_q, launch.splits, block_h=cfg.block_h,
                                                 block_n=cfg.block_n, num_warps=cfg.num_warps,
                                                 num_stages=cfg.num_stages, dv_halves=cfg.dv_halves,
                                                 fp8_native=launch.fp8_native, dot=tl_dot.OPERAND_DTYPE)
        self.has_extra = extra_k_cache is not None
        self.kwargs = dict(HAS_SINK=has_sink, HAS_LEN=has_len, HAS_EXTRA=self.has_extra, HAS_ELEN=has_elen,
                           PARTIAL=launch.splits > 1, **kw)
        self.main = (k_cache.stride(0), k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1])
        ec = extra_k_cache if self.has_extra else k_cache
        self.extra = (ec.stride(0), ec.shape[1], ec.shape[0] * ec.shape[1])
        self.topk, self.etopk = topk, extra_topk
        self.scale = (D_QK ** -0.5 if softmax_scale is None else float(softmax_scale)) * LOG2E
        self._decode = BoundLaunch(self.grid, self.kwargs)
        self._combine = BoundLaunch(*combine.launch_params(b * s_q, h_q, has_sink))

    def __call__(self, q, k_cache, indices, attn_sink, topk_length, extra_k_cache, extra_indices, extra_topk_length,
                 out, lse, po=None, plse=None) -> None:
        split = self.splits > 1
        if split and po is None:
            b = q.shape[0]
            po, plse = workspace(self.launch, b, self.s_q, self.h_q, q.device)
        indices = indices.contiguous()
        kc = _u8(k_cache)
        if self.has_extra:
            ec, eidx = _u8(extra_k_cache), extra_indices.contiguous()
        else:
            ec, eidx = kc, indices
        kernel = getattr(self._module, self._name)
        self._decode(kernel, (
            q.contiguous(), out, lse, lse if attn_sink is None else attn_sink, po if split else lse,
            plse if split else lse, kc, *self.main, indices, self.topk, indices if topk_length is None else topk_length,
            ec, *self.extra, eidx, self.etopk, indices if extra_topk_length is None else extra_topk_length,
            self.s_q, self.h_q, self.scale, self.splits))
        if split:
            self._combine(combine.combine_kernel, (po, plse, out, lse, lse if attn_sink is None else attn_sink,
                                                   self.s_q, self.h_q, self.splits))


#: Triton's launcher takes every argument, constexprs included, from 3.3 on
_LAUNCHER_TAKES_CONSTEXPRS = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 3)


def _addresses(args):
    """``args`` with each tensor replaced by its address, or None when an address is not a
    multiple of 16 bytes (Triton specializes on that)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.data_ptr()
            if a % 16:
                return None
        out.append(a)
    return out


class BoundLaunch:
    """One kernel of a :class:`Launcher`, launched the cheap way once it is compiled.

    ``kernel[grid](*args, **constexprs)`` binds and specializes every argument on every call:
    most of an eager call's host time. What it specializes on is fixed by the plan (the dtypes,
    the integers, the constexprs) except whether each pointer is a multiple of 16 bytes. So the
    first call whose pointers all are goes through Triton and keeps the compiled kernel it
    returns; later such calls launch that kernel directly, the constexprs appended in signature
    order. Any other call, or a kernel that is not compiled (the interpreter, a stub), takes
    Triton's path. The direct launch passes each tensor as its address: for a tensor, Triton's
    launcher asks the driver whether its pointer is a device one, a driver call per pointer
    that the plan's signature check (every tensor on the plan's device) already answers. (A
    compiled kernel's launcher takes a three-dimensional grid; Triton's path pads a shorter
    one, so the direct launch does too.)"""

    def __init__(self, grid, constexprs: dict):
        self.grid, self.constexprs = tuple(grid), constexprs
        self._grid3 = self.grid + (1,) * (3 - len(self.grid))
        self._kernel = self._compiled = self._tail = None

    def __call__(self, kernel, args: tuple) -> None:
        if self._compiled is not None and kernel is self._kernel:
            addresses = _addresses(args)
            if addresses is not None:
                self._compiled[self._grid3](*addresses, *self._tail)
                return
        compiled = kernel[self.grid](*args, **self.constexprs)
        if (self._compiled is None and isinstance(compiled, CompiledKernel) and _LAUNCHER_TAKES_CONSTEXPRS
                and _addresses(args) is not None):
            self._kernel, self._compiled, self._tail = kernel, compiled, self._constexpr_tail(kernel, len(args))

    def _constexpr_tail(self, kernel, n_args: int):
        """The kernel's parameters after the ``n_args`` given ones, in order: the constexprs as
        given, else their defaults (the compile options, such as ``num_warps``, are not parameters)."""
        params = list(inspect.signature(kernel.fn).parameters.values())[n_args:]
        tail = [self.constexprs.get(p.name, p.default) for p in params]
        if any(v is inspect.Parameter.empty for v in tail):
            raise TypeError(f"{kernel.fn.__name__}: no value for {[p.name for p in params]}")
        return tail


def run(launch: Launch, q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
        extra_topk_length, out, lse, po=None, plse=None) -> None:
    """Launch ``launch`` once (a :class:`Launcher` for this call) into ``out`` and ``lse``."""
    Launcher(launch, q.shape, k_cache, indices.shape[-1], extra_k_cache,
             extra_indices.shape[-1] if extra_k_cache is not None else 0, softmax_scale, attn_sink is not None,
             topk_length is not None, extra_topk_length is not None)(
        q, k_cache, indices, attn_sink, topk_length, extra_k_cache, extra_indices, extra_topk_length, out, lse, po, plse)


def run_simt(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
             extra_topk_length, out, lse) -> None:
    """Launch the SIMT baseline into ``out`` and ``lse``."""
    simt_sparse_decode(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
                       extra_topk_length, out=out, lse=lse)
