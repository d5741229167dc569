"""The launch rule: which kernel runs a call, in which form and config, on which schedule, and
the launch itself. The only module that imports both the configs and the kernels.

From the shapes and the device alone (no host sync), for ``impl="mma"``:

- on a Hopper GPU (sm_90) whose table allows it (:func:`mla.configs.gluon_enabled`), the Gluon
  kernel runs every call: heads as M where h_q > 16 and the grid fills the GPU; tokens as M
  (:func:`tokens_as_m`) where h_q <= 16 or the grid is small (:func:`small_grid`);
- anything else runs the portable ``tl.dot`` kernel with the shipped config for h_q, two
  programs per head block where the grid is small (:func:`fill_small_grid`);
- a Gluon pick whose caches it cannot copy (:func:`mla.kernels.gluon_sm90.row_align`) falls
  back to the ``tl.dot`` config;
- DeepSeek-V3.2's cache (:data:`mla.layout.V32`) runs the Gluon kernel in the heads-as-M form
  only (:data:`GLUON_LAYOUTS`): where MODEL1's call would take another form, it gets the pick of
  a GPU without Gluon (the ``tl.dot`` kernel);
- the schedule (:func:`programs_for`): the flat work list of :mod:`mla.schedule`, its share
  size from the shapes or, with lengths, from the lengths on the device; uniform splits for
  the one form with a program per query piece.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import operator

import torch
import triton
from triton.compiler import CompiledKernel

from . import _runtime, configs, schedule
from .configs import GLUON_FORMS, ClusterConfig, GluonConfig, PortableConfig, PrefillConfig, TlDotConfig
from .kernels import combine, cross_arch, prefill, tl_dot
from .kernels.common import LOG2E, fp8_native
from .kernels.simt import simt_sparse_decode
from .layout import D_V, MODEL1, V32, CacheLayout, cache_layout, fail

#: tokens per ring stage of the Gluon kernel (its schedule's tile)
GLUON_RING_N = 64

try:                       # Triton's runtime settings (launch hooks): Triton 3.4 and newer
    from triton import knobs
except ImportError:
    knobs = None

try:                       # Gluon's Hopper module and the portable Gluon kernel: Triton 3.5 and newer
    from .kernels import gluon_portable, gluon_sm90
except (ImportError, AttributeError):
    gluon_portable = gluon_sm90 = None

try:                       # the Gluon kernel's 2-CTA cluster form: CGA layouts and cross-CTA stores
    from .kernels.gluon_sm90 import cluster as gluon_cluster
except (ImportError, AttributeError, TypeError):
    gluon_cluster = None
if gluon_cluster is not None and not gluon_cluster.SUPPORTED:     # imports, but this Triton cannot build it
    gluon_cluster = None

#: the kernels that copy raw cache rows 8 or 16 bytes at a time (cp.async), as errors name them
RING_KERNELS = {"gluon": "the Gluon kernel", "gluon_portable": "the portable Gluon kernel",
                "gluon_cluster": "the cluster form"}
#: the SM count assumed under the interpreter (it sizes the split count only)
INTERPRETER_SMS = 4
#: the cache layouts the Gluon kernel reads, with its forms for each: V3.2's 576-wide Q and K fit
#: its shared memory in the heads-as-M form only
GLUON_LAYOUTS = {MODEL1: tuple(GLUON_FORMS), V32: ("heads as M",)}
#: the cache layouts the portable Gluon kernel reads
PORTABLE_LAYOUTS = (MODEL1,)


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
    when the head block is 64, two programs per head block (``dv_halves=2``) of 8 warps and one
    stage. Each repeats S = Q.K^T but owns half of P.V, so twice as many SMs work on the same
    query; at 8 warps its 256 accumulator columns and Q stay in registers (at 4 warps the loop
    spills). At larger grids the repeated Q.K^T costs more than it gains."""
    if cfg.dv_halves != 1 or cfg.block_h != 64 or not small_grid(cfg, b, s_q, h_q, topk_total, sms):
        return cfg
    return dataclasses.replace(cfg, dv_halves=2, num_warps=8, num_stages=1)


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


def programs_for(cfg, n_q: int, h_q: int, topk: int, extra_topk: int, sms: int, has_lengths: bool) -> tuple:
    """(programs, share) of a call: for the flat work list (:mod:`mla.schedule`), the persistent
    programs per head block and the share size in units, 0 for shares balanced over the programs
    (:func:`mla.schedule.share_range`; with lengths, always, the kernel summing them on the
    device over as many programs as the GPU runs at once); for the two-consumer form, the
    uniform splits of each query (:func:`num_splits`) and 0."""
    if cfg.kernel == "gluon" and cfg.two_consumers:
        return num_splits(n_q, 1, h_q, topk + extra_topk, cfg.block_h, cfg.block_n, 1, sms), 0
    heads = _cdiv(h_q, cfg.block_h) * getattr(cfg, "dv_halves", 1) * getattr(cfg, "ctas", 1)   # SMs a query
    slots = max(1, sms // heads)
    if cfg.kernel == "gluon":
        block_n, unit = GLUON_RING_N, cfg.block_n // GLUON_RING_N
    else:
        block_n, unit = cfg.block_n, 1
    units = schedule.query_units(topk, extra_topk, block_n, unit)[1]
    if has_lengths:
        return min(slots, n_q * units), 0
    return schedule.choose_cut(n_q, units, slots)


@dataclasses.dataclass(frozen=True)
class Launch:
    """What a tensor-core call launches: the config (its kernel and form), the schedule
    (:func:`programs_for`: ``programs`` and ``share``), whether the combine runs, and, for the
    Gluon kernel, the width of its ring's copies (:func:`~mla.kernels.gluon_sm90.row_align`)."""

    config: TlDotConfig | GluonConfig | PortableConfig | ClusterConfig
    programs: int
    share: int = 0
    combine: bool = True
    align: int = 0
    fp8_native: bool = False
    #: the architecture whose instruction set the ``tl.dot`` kernel is compiled for, assembled for
    #: this GPU (:mod:`mla.kernels.cross_arch`); 0: this GPU's own
    isa: int = 0

    @property
    def kernel(self) -> str:
        return self.config.kernel

    @property
    def flat(self) -> bool:
        """Whether the call runs the flat work list (every form but the two-consumer one)."""
        return not (self.config.kernel == "gluon" and self.config.two_consumers)

    @property
    def label(self) -> str:
        if self.isa:
            return f"{self.config.label} as sm_{self.isa} code, {self.programs} program(s)"
        if not self.flat:
            return f"{self.config.label}, {self.programs} split(s) per query"
        cut = f"shares of {self.share} units" if self.share else "balanced shares"
        return f"{self.config.label}, {self.programs} program(s), {cut}"


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


def gluon_portable_config(arch: int, h_q: int) -> PortableConfig:
    """The portable Gluon kernel's form for h_q on architecture ``arch``: the largest head block
    whose program fits that architecture's shared memory (:func:`mla.configs.portable_generic`)."""
    return configs.bucket_config(configs.portable_generic(arch), h_q)


def tl_dot_launch_config(device: torch.device, b: int, s_q: int, h_q: int, topk_total: int) -> TlDotConfig:
    """The ``tl.dot`` config that runs these shapes where there is no Gluon kernel: the shipped
    config for h_q with the small-grid rule (:func:`fill_small_grid`), on this device's SMs."""
    return fill_small_grid(tl_dot_config(device, h_q), b, s_q, h_q, topk_total, sm_count(device))


def gluon_align(k_cache, extra_k_cache=None) -> int:
    """The Gluon kernel's copy width for these caches (0: it cannot copy them, or no Gluon, or a
    layout it does not read)."""
    if gluon_sm90 is None or cache_layout(k_cache) not in GLUON_LAYOUTS:
        return 0
    caches = [(k_cache.view(torch.uint8), k_cache.stride(0))]
    if extra_k_cache is not None:
        caches.append((extra_k_cache.view(torch.uint8), extra_k_cache.stride(0)))
    return gluon_sm90.row_align(*caches)


def decide(table: dict, gluon: bool, sms: int, b: int, s_q: int, h_q: int, topk: int, extra_topk: int, align: int,
           has_lengths: bool = False, layout: CacheLayout = MODEL1):
    """(config, programs, share) that the launch rule picks on given facts, no GPU needed:
    ``table`` the ``tl.dot`` table of the GPU (:func:`mla.configs.table_for`), ``gluon`` whether
    the Gluon kernel may run, ``sms`` its SM count, ``align`` the caches' :func:`gluon_align`,
    ``has_lengths`` whether the call gives ``topk_length`` or ``extra_topk_length``, ``layout``
    the caches' layout (a Gluon form the layout does not have, :data:`GLUON_LAYOUTS`, gives the
    pick without Gluon)."""
    tl_cfg = configs.bucket_config(table, h_q)
    gluon = gluon and layout in GLUON_LAYOUTS
    cfg = choose_config(tl_cfg, gluon, b, s_q, h_q, topk + extra_topk, sms)
    if cfg.kernel == "gluon" and cfg.form not in GLUON_LAYOUTS[layout]:
        cfg = choose_config(tl_cfg, False, b, s_q, h_q, topk + extra_topk, sms)
    elif cfg.kernel == "gluon" and not align:     # caches the Gluon kernel cannot copy
        cfg = tl_cfg
    return (cfg, *programs_for(cfg, b * s_q, h_q, topk, extra_topk, sms, has_lengths))


def _units(cfg, topk: int, extra_topk: int) -> int:
    """Units of a query with every position valid, in the config's schedule unit."""
    if cfg.kernel == "gluon":
        return schedule.query_units(topk, extra_topk, GLUON_RING_N, cfg.block_n // GLUON_RING_N)[1]
    return schedule.query_units(topk, extra_topk, cfg.block_n)[1]


def _on_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU, not the interpreter: where the Gluon sm_90 kernels run."""
    return not _runtime.INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def plan_launch(device: torch.device, b: int, s_q: int, h_q: int, topk: int, extra_topk: int, align: int,
                has_lengths: bool = False, config=None, programs: int | None = None, isa: int = 0,
                layout: CacheLayout = MODEL1) -> Launch:
    """The launch for these shapes on ``device``; ``align`` is :func:`gluon_align` of the caches
    (0 where there is no Gluon), ``layout`` their layout. ``config`` and ``programs`` force a
    choice (tests, experiments): ``programs`` balanced shares of the work list (or uniform splits
    of each query, for the two-consumer form). ``isa`` (80, 86 or 89) runs a portable kernel as
    that architecture compiles it (:mod:`mla.kernels.cross_arch`), with that architecture's
    generic table and FP8 decode, on this GPU's SMs: what an A100 or an L40 executes, timed here."""
    sms, table, gluon, native = _facts(device)
    if isa:
        if isa not in cross_arch.ISAS:
            fail("isa", f"expected one of {cross_arch.ISAS} (0: this GPU's own code), got {isa!r}")
        if table is None:
            fail("isa", f"another architecture's code runs on a CUDA GPU only (not the interpreter); this device is "
                        f"{device}")
        if config is not None and config.kernel in ("gluon", "gluon_cluster"):
            fail("isa", "only the portable kernels (tl.dot, Gluon portable) are compiled for another architecture")
        table, gluon, native = configs.generic(isa), False, isa >= 89
    if config is not None:
        cfg = config.for_heads(h_q)
        if cfg.kernel == "gluon":
            if cfg.form not in GLUON_LAYOUTS.get(layout, ()):
                raise ValueError(f"config: the Gluon kernel reads {layout.name}'s cache in the forms "
                                 f"{list(GLUON_LAYOUTS.get(layout, ()))} only, not {cfg.form!r}: force one of "
                                 "those or a TlDotConfig, or leave config to the launch rule")
            if gluon_sm90 is None or not _on_hopper(device):
                raise ValueError("config: the Gluon kernel is for Hopper GPUs (sm_90, not the interpreter); "
                                 f"this device is {device}")
        elif cfg.kernel == "gluon_portable":
            if layout not in PORTABLE_LAYOUTS:
                raise ValueError(f"config: the portable Gluon kernel reads the MODEL1 cache only, not {layout.name}'s: "
                                 "force a TlDotConfig, or leave config to the launch rule")
            if gluon_portable is None or _runtime.INTERPRET or device.type != "cuda":
                raise ValueError("config: the portable Gluon kernel runs on a CUDA GPU (not the interpreter); this "
                                 f"device is {device}")
        elif cfg.kernel == "gluon_cluster":
            if layout is not MODEL1:
                raise ValueError(f"config: the cluster form reads the MODEL1 cache only, not {layout.name}'s: force a "
                                 "GluonConfig, or leave config to the launch rule")
            if gluon_cluster is None:
                raise ValueError(f"config: the cluster form needs Triton 3.9 or newer (its Gluon's cross-CTA stores); "
                                 f"this is Triton {triton.__version__}")
            if not _on_hopper(device):
                raise ValueError(f"config: the cluster form is for Hopper GPUs (sm_90, not the interpreter); this "
                                 f"device is {device}")
        if cfg.kernel in RING_KERNELS and not align:
            raise ValueError(f"config: {RING_KERNELS[cfg.kernel]} copies cache rows 8 or 16 bytes at a time: it "
                             "needs caches whose base addresses are multiples of 16 and page strides multiples of 8")
    elif table is None:                        # the interpreter: one small config
        cfg = tl_dot_config(device, h_q)
    else:
        cfg = decide(table, gluon, sms, b, s_q, h_q, topk, extra_topk, align, layout=layout)[0]
    n_q = b * s_q
    if programs is None:
        programs, share = programs_for(cfg, n_q, h_q, topk, extra_topk, sms, has_lengths)
    else:
        share = 0
    launch = Launch(cfg, programs, share, True, align if cfg.kernel in RING_KERNELS else 0, native, isa)
    return dataclasses.replace(launch, combine=needs_combine(launch, n_q, topk, extra_topk, has_lengths))


def needs_combine(launch: Launch, n_q: int, topk: int, extra_topk: int, has_lengths: bool) -> bool:
    """Whether a launch may split a query, so that the combine must run: with lengths on the
    device, always; else where a share ends inside a query (for the two-consumer form, where
    each query has more than one split)."""
    if not launch.flat:
        return launch.programs > 1
    units = _units(launch.config, topk, extra_topk)
    return has_lengths or schedule.splits_a_query(n_q, units, launch.programs, launch.share)


def workspace(launch: Launch, b: int, s_q: int, h_q: int, device) -> tuple:
    """The buffers of a call beside its output: the split partials (outputs as fp16, lse in log2
    units; None where no query is split) and, for the flat work list, each share's record for
    the combine and, after them, one per query row (:func:`mla.kernels.common.write_share_record`)."""
    slots = 2 * launch.programs if launch.flat else b * s_q * launch.programs
    po = plse = None
    if launch.combine:
        po = torch.empty(slots, h_q, D_V, dtype=torch.float16, device=device)
        plse = torch.empty(slots, h_q, dtype=torch.float32, device=device)
    rec = torch.empty(3 * launch.programs + b * s_q if launch.flat else 3, dtype=torch.int32, device=device)
    return po, plse, rec


def _u8(cache):
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


#: where a call's tensors go among the decode kernels' arguments (the flat kernels and the Gluon
#: one share one signature): q, out, lse, the sink, the partials, the records, the main cache,
#: its indices and lengths, the extra cache, its indices and lengths
_DECODE_TENSORS = (0, 4, 5, 6, 8, 9, 10, 11, 15, 19, 21, 25, 29)
#: and the combine's: the partials, the records, out, lse, the sink
_COMBINE_TENSORS = (0, 1, 2, 3, 4, 5)
#: the caches among them, which Triton's path takes as uint8
_CACHE_SLOTS = (11, 21)
#: where the combine's tensors are among the decode's (:meth:`Launcher.__call__`), so that the
#: combine's launch picks its addresses from the decode's
_COMBINE_FROM_DECODE = (4, 5, 6, 1, 2, 3)


class Launcher:
    """A launch bound to what its calls share (made once per plan): the kernels' grids and
    constexprs, and every integer argument (the strides of q, the indices and the lengths, the
    caches' page strides and sizes, the top-k widths, the scale, the schedule), which the plan's
    signature fixes. Called with a call's tensors, it launches the decode, and the combine when a
    query may be split. The kernels are looked up at the call, so that a stub can stand in."""

    def __init__(self, launch: Launch, q, k_cache, indices, attn_sink=None, topk_length=None, extra_k_cache=None,
                 extra_indices=None, extra_topk_length=None, softmax_scale=None):
        b, s_q, h_q, d_qk = q.shape
        self.launch, self.n_q, self.s_q, self.h_q = launch, b * s_q, s_q, h_q
        cfg = launch.config
        v32 = cache_layout(k_cache) is V32
        if cfg.kernel == "gluon":
            heads, tile_tokens, pair = GLUON_FORMS[cfg.form]
            self._module, self._name = gluon_sm90.kernel, "gluon_decode_kernel"
            grid, kw = gluon_sm90.launch_params(b * s_q, h_q, launch.programs, heads=heads, tile_tokens=tile_tokens,
                                                two_consumers=pair, align=launch.align, v32=v32)
        elif cfg.kernel == "gluon_cluster":
            self._module, self._name = gluon_cluster, "gluon_cluster_kernel"
            grid, kw = gluon_cluster.launch_params(h_q, launch.programs, align=launch.align)
        elif cfg.kernel == "gluon_portable":
            self._module, self._name = (cross_arch, f"gluon_portable_sm{launch.isa}") if launch.isa else \
                (gluon_portable, "gluon_portable_kernel")
            grid, kw = gluon_portable.launch_params(h_q, launch.programs, block_h=cfg.block_h, block_n=cfg.block_n,
                                                    fp8_native=launch.fp8_native, align=launch.align,
                                                    stages=cfg.stages)
        else:
            self._module, self._name = (cross_arch, f"tl_dot_sm{launch.isa}") if launch.isa else \
                (tl_dot, "tl_dot_decode_kernel")
            grid, kw = tl_dot.launch_params(h_q, launch.programs, block_h=cfg.block_h, block_n=cfg.block_n,
                                            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                            dv_halves=cfg.dv_halves, fp8_native=launch.fp8_native,
                                            dot=tl_dot.OPERAND_DTYPE, v32=v32)
        self.has_extra = extra_k_cache is not None
        self.kwargs = dict(HAS_SINK=attn_sink is not None, HAS_LEN=topk_length is not None,
                           HAS_EXTRA=self.has_extra, HAS_ELEN=extra_topk_length is not None, **kw)
        ec = extra_k_cache if self.has_extra else k_cache
        ei = extra_indices if self.has_extra else indices
        scale = (d_qk ** -0.5 if softmax_scale is None else float(softmax_scale)) * LOG2E
        template = [None, *q.stride()[:3], None, None, None, 0 if attn_sink is None else attn_sink.stride(0), None,
                    None, None,
                    None, k_cache.stride(0), k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1],
                    None, *indices.stride()[:2], indices.shape[-1], None, 0 if topk_length is None else topk_length.stride(0),
                    None, ec.stride(0), ec.shape[1], ec.shape[0] * ec.shape[1],
                    None, *ei.stride()[:2], extra_indices.shape[-1] if self.has_extra else 0, None,
                    0 if extra_topk_length is None else extra_topk_length.stride(0),
                    b * s_q, s_q, h_q, scale, launch.share, launch.programs]
        self._decode = BoundLaunch(grid, self.kwargs, template, _DECODE_TENSORS, _CACHE_SLOTS, q.device)
        cgrid, ckw = combine.launch_params(launch.programs, b * s_q, h_q, attn_sink is not None, launch.flat)
        ctemplate = [None] * 6 + [0 if attn_sink is None else attn_sink.stride(0), s_q, h_q, launch.programs]
        self._combine = BoundLaunch(cgrid, ckw, ctemplate, _COMBINE_TENSORS, (), q.device,
                                    sources=(_COMBINE_FROM_DECODE, len(_DECODE_TENSORS)))
        self._workspace = self._workspace_addresses = None

    def __call__(self, q, k_cache, indices, attn_sink, topk_length, extra_k_cache, extra_indices, extra_topk_length,
                 out, lse, po=None, plse=None, rec=None) -> None:
        if rec is None:
            po, plse, rec = workspace(self.launch, self.n_q, 1, self.h_q, q.device)
        combine_ = self.launch.combine
        if not combine_:                 # no query is split: lse stands in for the partials
            po = plse = lse
        sink = lse if attn_sink is None else attn_sink
        if self.has_extra:
            ec, eidx = extra_k_cache, extra_indices
        else:
            ec, eidx = k_cache, indices
        tensors = (q, out, lse, sink, po, plse, rec, k_cache, indices,
                   indices if topk_length is None else topk_length, ec, eidx,
                   indices if extra_topk_length is None else extra_topk_length)
        addresses = self._addresses(tensors)
        self._decode(getattr(self._module, self._name), tensors, addresses)
        if combine_:      # the combine's tensors are the decode's partials, records, out, lse and sink
            self._combine(combine.combine_kernel, (po, plse, rec, out, lse, sink), addresses)

    def _addresses(self, tensors):
        """The decode tensors' addresses (each distinct tensor asked once; the workspace's kept
        while it is the same), or None when one is not a multiple of 16 bytes (Triton specializes
        on that). A Gluon launch raises instead where a cache is not: its copies need it."""
        q, out, lse, sink, po, plse, rec, k_cache, indices, lengths, ec, eidx, elengths = tensors
        if rec is not self._workspace:
            self._workspace, self._workspace_addresses = rec, (po.data_ptr(), plse.data_ptr(), rec.data_ptr())
        a_q, a_out, a_lse, a_kc, a_idx = q.data_ptr(), out.data_ptr(), lse.data_ptr(), k_cache.data_ptr(), \
            indices.data_ptr()
        a_sink = a_lse if sink is lse else sink.data_ptr()
        a_len = a_idx if lengths is indices else lengths.data_ptr()
        a_ec = a_kc if ec is k_cache else ec.data_ptr()
        a_eidx = a_idx if eidx is indices else eidx.data_ptr()
        a_elen = a_idx if elengths is indices else elengths.data_ptr()
        a_po, a_plse, a_rec = self._workspace_addresses
        if not (a_q | a_out | a_lse | a_sink | a_po | a_plse | a_rec | a_kc | a_idx | a_len | a_ec | a_eidx
                | a_elen) & 15:
            return [a_q, a_out, a_lse, a_sink, a_po, a_plse, a_rec, a_kc, a_idx, a_len, a_ec, a_eidx, a_elen]
        if self.launch.align and (a_kc | a_ec) & 15:
            fail("k_cache" if a_kc & 15 else "extra_k_cache",
                 "its address is not a multiple of 16 bytes, which the plan's Gluon kernel copies need: make a "
                 "new plan for it (through mla.flash_mla, a new metadata object)")
        return None


#: Triton's launcher takes every argument, constexprs included, from 3.3 on
_LAUNCHER_TAKES_CONSTEXPRS = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 3)


def _addresses(tensors):
    """The tensors' addresses, or None when one is not a multiple of 16 bytes (Triton
    specializes on that)."""
    out = [t.data_ptr() for t in tensors]
    return None if functools.reduce(operator.or_, out) & 15 else out


def _hooked(hook) -> bool:
    """Whether a launch hook is set (a callable, or a non-empty chain of them)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _direct_launch(compiled, grid3, order, consts, n_addresses):
    """``launch(stream, addresses)`` straight into a compiled kernel's C launcher, below Triton's
    Python wrapper (which per call looks the device and stream up, builds the launch metadata
    and asks for scratch memory), or None where this Triton's compiled kernel does not have that
    shape, needs scratch memory, or a launch hook (a profiler) is set.

    The call is written out once, as source (the way Triton writes its own launchers): the grid,
    the function handle, its flags and metadata, then each kernel argument in order, either
    ``addresses[i]`` or one of the plan's fixed values (``order`` indexes ``addresses + consts``),
    so that a launch builds no argument tuple of its own."""
    run = getattr(compiled, "_run", None)
    launch = getattr(run, "launch", None)
    if (launch is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or getattr(run, "gsan_enabled", False)
            or knobs is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
        return None
    names = {"launch": launch, "fn": compiled.function, "meta": compiled.packed_metadata,
             "coop": run.launch_cooperative_grid, "pdl": run.launch_pdl}
    # Triton 3.9's C launcher takes the arguments' annotations and signature, then the arguments
    # as one tuple; 3.3 to 3.8's take the arguments one by one
    packed = hasattr(run, "kernel_signature")
    if packed:
        names.update(notes=run.arg_annotations, sig=run.kernel_signature)
    args = []
    for j in order:
        if j < n_addresses:
            args.append(f"a[{j}]")
        else:
            names[f"c{j}"] = consts[j - n_addresses]
            args.append(f"c{j}")
    gx, gy, gz = (int(g) for g in grid3)
    head = f"launch({gx}, {gy}, {gz}, stream, fn, coop, pdl, "
    if packed:
        call = head + f"meta, None, None, None, None, None, notes, sig, ({', '.join(args)},))"
    else:
        call = head + f"None, None, meta, None, None, None, {', '.join(args)})"
    source = f"def direct(stream, a):\n    {call}\n"
    exec(compile(source, f"<mla direct launch of {getattr(compiled, 'name', 'a kernel')}>", "exec"), names)
    return names["direct"]


class BoundLaunch:
    """One kernel of a :class:`Launcher`, launched the cheap way once it is compiled.

    ``kernel[grid](*args, **constexprs)`` binds and specializes every argument on every call:
    most of an eager call's host time. What it specializes on is fixed by the plan (the dtypes,
    the integers, the constexprs) except whether each pointer is a multiple of 16 bytes. So the
    first call whose pointers all are goes through Triton and keeps the compiled kernel it
    returns; later such calls launch that kernel directly: the plan's integer arguments with
    the call's tensor addresses, the constexprs appended in signature order, into the compiled
    kernel's C launcher on the current stream (:func:`_direct_launch`; through
    ``CompiledKernel[grid]`` where it cannot). Any other call, or a kernel that is not compiled
    (the interpreter, a stub), takes Triton's path. (Addresses, not tensors: for a tensor the
    launcher asks the driver whether its pointer is a device one, which the plan's signature
    check already answered.)"""

    def __init__(self, grid, constexprs: dict, template, tensor_slots, cache_slots=(), device=None, sources=None):
        self.grid, self.constexprs = tuple(grid), constexprs
        self._grid3 = self.grid + (1,) * (3 - len(self.grid))
        self._template, self._slots, self._caches = list(template), tuple(tensor_slots), set(cache_slots)
        # where each tensor's address is in the addresses a call passes, and how many those are:
        # its own tensors' by default, another launch's (the decode's, for the combine) if given
        self._own_addresses = sources is None
        self._sources, self._n_addresses = sources or (tuple(range(len(self._slots))), len(self._slots))
        self._device = device.index if device is not None and device.type == "cuda" else None
        self._kernel = self._compiled = self._direct = self._pick = self._consts = None

    def _args(self, values) -> list:
        args = list(self._template)
        for i, v in zip(self._slots, values):
            args[i] = v
        return args

    def _bind(self, kernel) -> None:
        """The compiled launch's argument order, as one pick (``self._pick``) from the call's
        addresses followed by the plan's fixed values (``self._consts``: the template's integers
        and the constexprs in signature order, :meth:`_constexpr_tail`)."""
        slot = dict(zip(self._slots, self._sources))
        consts, order = [], []
        for j, v in enumerate(self._template):
            if j in slot:
                order.append(slot[j])
            else:
                order.append(self._n_addresses + len(consts))
                consts.append(v)
        for v in self._constexpr_tail(kernel, len(self._template)):
            order.append(self._n_addresses + len(consts))
            consts.append(v)
        self._consts, self._order, self._pick = consts, order, operator.itemgetter(*order)

    def __call__(self, kernel, tensors: tuple, addresses=None) -> None:
        """Launch ``kernel`` with ``tensors`` in the template's tensor slots (``addresses``: theirs,
        from :func:`_addresses`, where the caller has them; for a launch bound to another's
        addresses, those, or None for Triton's path)."""
        if self._compiled is not None and kernel is self._kernel:
            if addresses is None and self._own_addresses:
                addresses = _addresses(tensors)
            if addresses is not None:
                if self._direct is not None:
                    self._direct(torch._C._cuda_getCurrentRawStream(self._device), addresses)
                else:
                    self._compiled[self._grid3](*self._pick(addresses + self._consts))
                return
        args = self._args([_u8(t) if i in self._caches else t for i, t in zip(self._slots, tensors)])
        compiled = kernel[self.grid](*args, **self.constexprs)
        if (self._compiled is None and isinstance(compiled, CompiledKernel) and _LAUNCHER_TAKES_CONSTEXPRS
                and _addresses(tensors) is not None):
            self._bind(kernel)
            self._kernel, self._compiled = kernel, compiled
            self._direct = (None if self._device is None else
                            _direct_launch(compiled, self._grid3, self._order, self._consts, self._n_addresses))

    def _constexpr_tail(self, kernel, n_args: int):
        """The kernel's parameters after the ``n_args`` given ones, in order: the constexprs as
        given, else their defaults (the compile options, such as ``num_warps``, are not parameters)."""
        params = list(inspect.signature(kernel.fn).parameters.values())[n_args:]
        tail = [self.constexprs.get(p.name, p.default) for p in params]
        if any(v is inspect.Parameter.empty for v in tail):
            raise TypeError(f"{kernel.fn.__name__}: no value for {[p.name for p in params]}")
        return tail


def run(launch: Launch, q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
        extra_topk_length, out, lse) -> None:
    """Launch ``launch`` once (a :class:`Launcher` for this call) into ``out`` and ``lse``."""
    Launcher(launch, q, k_cache, indices, attn_sink, topk_length, extra_k_cache, extra_indices, extra_topk_length,
             softmax_scale)(q, k_cache, indices, attn_sink, topk_length, extra_k_cache, extra_indices,
                            extra_topk_length, out, lse)


def run_simt(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
             extra_topk_length, out, lse) -> None:
    """Launch the SIMT baseline into ``out`` and ``lse``."""
    simt_sparse_decode(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
                       extra_topk_length, out=out, lse=lse)


def prefill_config(device: torch.device, h_q: int) -> PrefillConfig:
    """The sparse prefill's config for h_q on ``device``: its architecture's
    (:func:`mla.configs.prefill_config`), the interpreter's off a GPU, sized for h_q's head block."""
    if _runtime.INTERPRET or device.type != "cuda":
        return configs.PREFILL_INTERPRETER.for_heads(h_q)
    major, minor = torch.cuda.get_device_capability(device)
    return configs.prefill_config(10 * major + minor).for_heads(h_q)


def run_prefill(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse, config=None) -> None:
    """Launch the sparse prefill (:mod:`mla.kernels.prefill`) into ``out``, ``max_logits`` and
    ``lse``, with ``config`` (a :class:`~mla.configs.PrefillConfig`) or the device's. The
    arguments are checked (:func:`mla.api.check_prefill_inputs`); ``kv`` and ``indices`` have one
    KV head."""
    s_q, h_q, d_qk = q.shape
    cfg = (config or prefill_config(q.device, h_q)).for_heads(h_q)
    grid, kw = prefill.launch_params(s_q, h_q, d_qk, block_h=cfg.block_h, block_n=cfg.block_n,
                                     num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                     dot=prefill.operand_dtype(cfg.dot))
    sink = attn_sink if attn_sink is not None else lse          # a stand-in pointer, never read
    length = topk_length if topk_length is not None else indices
    prefill.sparse_prefill_kernel[grid](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), indices, indices.stride(0), length, length.stride(0), sink,
        sink.stride(0), out, out.stride(0), out.stride(1), max_logits, lse, kv.shape[0], indices.shape[-1], h_q,
        float(sm_scale) * LOG2E, HAS_SINK=attn_sink is not None, HAS_LEN=topk_length is not None, **kw)
