"""Benchmark protocol of the contract: ceilings, shapes, CUDA-graph and eager timing, JSON records.

``python -m mla.bench`` runs the contract's shapes for each impl on the GPU it finds, prints a
table and writes ``results/<gpu-slug>/<name>.json`` (``results/h200/bench.json`` on an H200). It
refuses to run under Triton's CPU interpreter: an interpreter timing means nothing. Impls:
``mma`` (with a plan made once per shape), ``simt``, ``reference`` and, where its extension
imports, ``flashmla`` (DeepSeek's FlashMLA, timed in the same run under the same protocol).
``python -m mla.bench --compare A.json B.json`` compares two such files (no GPU needed): the ratio
of CUDA-graph times, B over A, per shape, batch and impl.
``python -m mla.bench --prefill`` times the sparse prefill (:func:`mla.sparse_prefill`, and
FlashMLA's ``flash_mla_sparse_fwd`` where it imports) over its grid into
``results/<gpu-slug>/prefill.json``.
``python -m mla.bench --host`` measures the Python a call costs before its launches (on any
machine: the launches are stubbed), with a plan and without one.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import io
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
import timeit
from dataclasses import dataclass

import torch
import triton
from triton.compiler import CompiledKernel

from . import api, configs, dispatch
from .kernels import combine, tl_dot
from .layout import D_QK, D_V, MODEL1, TOKEN_BYTES, CacheLayout, empty_cache, layout_for_head_dim, page_stride, \
    quantize_kv, token_bytes

try:                     # DeepSeek's FlashMLA, where its extension is built (impl "flashmla")
    import flash_mla
except ImportError:      # also its extension missing or built for another torch
    flash_mla = None


@dataclass(frozen=True)
class Shape:
    """One benchmark case of the SPEC."""

    name: str
    b: int
    s_q: int
    h_q: int
    topk: int
    page: int
    extra_topk: int = 0
    extra_page: int = 64
    lengths: bool = False          # topk_length (and extra_topk_length with an extra cache) given
    d_qk: int = D_QK               # q's head dim, which names the cache's layout (576: DeepSeek-V3.2's)

    @property
    def topk_total(self) -> int:
        return self.topk + self.extra_topk

    @property
    def layout(self) -> CacheLayout:
        return layout_for_head_dim(self.d_qk)


def spec_shapes() -> list[Shape]:
    """The SPEC's production cases (FlashMLA's), in a fixed order."""
    out = [Shape("DSA", b, 1, 64, 2048, 64) for b in (1, 8, 32, 64, 128)]
    out.append(Shape("DSA s_q 2", 64, 2, 64, 2048, 64))
    out += [Shape("V4-CSA", b, 1, 64, 128, 256, 512, 64) for b in (1, 32, 128)]
    out += [Shape("V4-TP8", b, 1, 8, 128, 256, 512, 64) for b in (1, 32, 128)]
    return out


#: FlashMLA sm90 CUDA-graph time per call on one H200 (SPEC, "Where the field stands"), us.
#: At V4-TP8 FlashMLA needs 64 heads, so its time is the padded V4-CSA time.
FLASHMLA_H200_US = {("DSA", 1): 18.5, ("DSA", 8): 22.9, ("DSA", 32): 51.8, ("DSA", 64): 83.2,
                    ("DSA", 128): 127.5, ("DSA s_q 2", 64): 126.8, ("V4-CSA", 1): 13.6,
                    ("V4-CSA", 32): 25.5, ("V4-CSA", 128): 47.3, ("V4-TP8", 1): 13.6,
                    ("V4-TP8", 32): 25.5, ("V4-TP8", 128): 47.3}

#: Where the field stands (SPEC): CUDA-graph time per call, us, of other implementations at the
#: SPEC's shapes, keyed by (shape name, b). Measured elsewhere, on one H200 in Nov 2026, not by
#: this package and not in the same run as our records: the same card model, another card.
#: "plain PyTorch" is that measurement's own PyTorch code, not our ``impl="reference"``.
PEERS_H200_US = {
    "FlashMLA sm90": FLASHMLA_H200_US,
    "SGLang DSv4 Triton": {("DSA", 64): 3302.0, ("V4-CSA", 32): 559.0},
    "plain PyTorch": {("DSA", 64): 1173.0},
}

#: A random gather of 584-byte tokens on the same card model (SPEC, measured elsewhere), GB/s:
#: the bandwidth a sparse decode can actually reach, below the copy ceiling.
GATHER_H200_GBPS = (2300.0, 2850.0)


def traffic_bytes(s: Shape) -> int:
    """Bytes that must move: gathered tokens * their bytes (584, or 656 for V3.2) + indices + q +
    out + lse."""
    n_q = s.b * s.s_q
    return (n_q * s.topk_total * (s.layout.token_bytes + 4) + n_q * s.h_q * (s.d_qk + D_V) * 2
            + n_q * s.h_q * 4)


def flops(s: Shape) -> int:
    """2 * b * s_q * h_q * topk_total * (d_qk for Q.K + 512 for P.V)."""
    return 2 * s.b * s.s_q * s.h_q * s.topk_total * (s.d_qk + D_V)


def random_cache(num_blocks: int, page: int, device, generator=None, chunk_tokens: int = 1 << 20,
                 layout: CacheLayout = MODEL1) -> torch.Tensor:
    """A cache (MODEL1's, or ``layout``'s) holding :func:`mla.quantize_kv` of N(0, 1) latents, as
    FlashMLA's tests use, quantized in chunks so that multi-GB pools fit in memory."""
    cache = empty_cache(num_blocks, page, device=device, fill=0, layout=layout)
    ps = page_stride(page, layout)
    flat = torch.as_strided(cache.view(torch.uint8), (num_blocks, ps), (cache.stride(0), 1))
    step = max(1, chunk_tokens // page)
    for lo in range(0, num_blocks, step):
        hi = min(num_blocks, lo + step)
        kv = torch.randn(hi - lo, page, layout.d_qk, device=device, generator=generator).bfloat16()
        flat[lo:hi] = torch.as_strided(quantize_kv(kv).view(torch.uint8), (hi - lo, ps), (ps, 1))
    return cache


def random_indices(b, s_q, topk, n_tokens, device, generator=None) -> torch.Tensor:
    """Random token indices in [0, n_tokens). Drawn with replacement: over a pool of millions of
    tokens a query repeats a token with probability about topk/n_tokens (well under 0.1%)."""
    return torch.randint(0, n_tokens, (b, s_q, topk), dtype=torch.int32, device=device, generator=generator)


class Case:
    """Inputs of one shape over pools far larger than L2, with several index sets."""

    def __init__(self, s: Shape, device, pool_bytes: float = 2e9, n_sets: int = 16, seed: int = 0, pools=None):
        g = torch.Generator(device=device).manual_seed(seed)
        self.shape = s
        self.cache = self._pool(pools, s.page, pool_bytes, device, g, s.layout)
        self.q = torch.randn(s.b, s.s_q, s.h_q, s.d_qk, device=device, generator=g).bfloat16()
        self.sink = torch.randn(s.h_q, device=device, generator=g)
        n = self.cache.shape[0] * s.page
        self.index_sets = [random_indices(s.b, s.s_q, s.topk, n, device, g) for _ in range(n_sets)]
        self.extra = None
        self.extra_sets = [None] * n_sets
        self.lengths = self.extra_lengths = None
        if s.extra_topk:
            self.extra = self._pool(pools, s.extra_page, pool_bytes / 2, device, g, s.layout)
            self.extra_sets = [random_indices(s.b, s.s_q, s.extra_topk, self.extra.shape[0] * s.extra_page, device, g)
                               for _ in range(n_sets)]
        if s.lengths:               # each batch row's valid prefix, uniform in [1, topk]
            self.lengths = torch.randint(1, s.topk + 1, (s.b,), dtype=torch.int32, device=device, generator=g)
            if s.extra_topk:
                self.extra_lengths = torch.randint(1, s.extra_topk + 1, (s.b,), dtype=torch.int32, device=device,
                                                   generator=g)

    @staticmethod
    def _pool(pools, page, pool_bytes, device, g, layout=MODEL1):
        """A cache of ``pool_bytes`` at this page size (of ``layout``), taken from ``pools`` (a dict
        a sweep keeps, keyed by page size, bytes and layout) when it holds one."""
        key = (page, int(pool_bytes), layout.name)
        if pools is not None and key in pools:
            return pools[key]
        cache = random_cache(max(1, int(pool_bytes // page_stride(page, layout))), page, device, g, layout=layout)
        if pools is not None:
            pools[key] = cache
        return cache

    def kwargs(self, i: int = 0) -> dict:
        kw = dict(attn_sink=self.sink)
        if self.lengths is not None:
            kw["topk_length"] = self.lengths
        if self.extra is not None:
            kw.update(extra_k_cache=self.extra, extra_indices=self.extra_sets[i])
            if self.extra_lengths is not None:
                kw["extra_topk_length"] = self.extra_lengths
        return kw

    def call(self, fn, i: int = 0):
        return fn(self.q, self.cache, self.index_sets[i], **self.kwargs(i))

    def caller(self, impl: str, **plan_options):
        """``f(i)``: one call of ``impl`` on index set ``i``. ``mma`` uses one plan made here (as
        a serving step would; ``plan_options``, such as ``config`` or ``programs``, go to
        :func:`mla.plan`); ``mma-unplanned`` the call without one; ``tl_dot`` the portable
        ``tl.dot`` kernel forced, with the shipped config and small-grid rule (what runs off
        Hopper); ``flashmla`` FlashMLA's own call, its metadata object made here and filled by its
        first call. ``tl_dot_sm80`` and ``tl_dot_sm89`` run the portable kernel as an A100 and an L40
        compile it, with their generic tables (:mod:`mla.kernels.cross_arch`); ``gluon_portable``
        (and ``_sm80``, ``_sm89``) the portable Gluon kernel, in the form that fits each one's shared
        memory; ``mma_cluster`` the Gluon kernel's 2-CTA cluster form (128 heads a cluster)."""
        if impl in PLANNED:
            s = self.shape
            if impl == MMA_CLUSTER:
                plan_options["config"] = configs.ClusterConfig()
            elif impl == "tl_dot":
                plan_options["config"] = dispatch.tl_dot_launch_config(self.q.device, s.b, s.s_q, s.h_q, s.topk_total)
            elif impl in PORTABLE_ISAS:
                plan_options["isa"] = PORTABLE_ISAS[impl]
            elif impl in GLUON_PORTABLE:
                isa = GLUON_PORTABLE[impl]
                arch = isa or 10 * torch.cuda.get_device_capability(self.q.device)[0]
                plan_options.update(config=dispatch.gluon_portable_config(arch, s.h_q), isa=isa)
            plan = api.plan(self.q, self.cache, self.index_sets[0], **self.kwargs(0), **plan_options)
            kwargs = [self.kwargs(i) for i in range(len(self.index_sets))]   # made once, as FlashMLA's are

            def call(i):
                return api.sparse_decode(self.q, self.cache, self.index_sets[i], **kwargs[i], plan=plan)
            call.plan = plan            # for the record: which kernel, form and split count
            return call
        if impl == "mma-unplanned":
            return lambda i: api.sparse_decode(self.q, self.cache, self.index_sets[i], **self.kwargs(i))
        if impl == "flashmla":
            if flash_mla is None:
                raise RuntimeError("impl 'flashmla': the flash_mla extension does not import here")
            meta, _ = flash_mla.get_mla_metadata()
            q, sink = self.q, self.sink
            if self.shape.h_q < FLASHMLA_HEADS[0]:        # padded to 64 heads, as a server would
                pad = FLASHMLA_HEADS[0] - self.shape.h_q
                q = torch.nn.functional.pad(q, (0, 0, 0, pad))
                sink = torch.nn.functional.pad(sink, (0, pad))
            return lambda i: flash_mla.flash_mla_with_kvcache(
                q, self.cache, None, None, D_V, meta, is_fp8_kvcache=True, indices=self.index_sets[i],
                attn_sink=sink, extra_k_cache=self.extra, extra_indices_in_kvcache=self.extra_sets[i],
                topk_length=self.lengths, extra_topk_length=self.extra_lengths)
        return lambda i: api.sparse_decode(self.q, self.cache, self.index_sets[i], **self.kwargs(i), impl=impl)


def time_graph(case: Case, call, replays: int = 20) -> float:
    """Median us per call of a CUDA graph holding one ``call(i)`` per index set, replayed."""
    n = len(case.index_sets)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n):          # warm-up: compile and allocate outside the capture
            call(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            call(i)
    g.replay()
    torch.cuda.synchronize()
    us = replay_us(g, n, replays)
    del g
    return us


def replay_us(graph, calls: int, replays: int) -> float:
    """Median us per call over ``replays`` replays of a CUDA graph that holds ``calls`` calls."""
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def time_do_bench(case: Case, call) -> float:
    """``triton.testing.do_bench``'s median, us, one index set after another. do_bench flushes
    the L2 before each call and times each call alone, so the host's work hides behind the flush:
    this is the GPU time of a call outside a graph, not what an eager loop pays (:func:`time_eager_loop`)."""
    it = iter(range(10 ** 9))
    return triton.testing.do_bench(lambda: call(next(it) % len(case.index_sets)),
                                   warmup=25, rep=100, return_mode="median") * 1e3


def time_eager_loops(case: Case, calls: dict, n_calls: int = 200, reps: int = 3) -> dict:
    """The wall time per call, us, of ``n_calls`` back-to-back eager calls with no
    synchronization between them (one index set after another), for each of ``calls`` (a name
    and its ``f(i)``): what a serving loop that does not capture graphs pays, host work included.
    The loops take turns, ``reps`` rounds of one loop each, and each keeps its fastest: such a loop
    runs at the host's pace below a few tens of us of kernel, and the host's other work only ever
    slows it, so that a slow spell of the machine falls on every call alike rather than on one."""
    n = len(case.index_sets)
    for call in calls.values():
        for i in range(n):
            call(i)
    torch.cuda.synchronize()
    best = {}
    for _ in range(reps):
        for name, call in calls.items():
            t0 = time.perf_counter()
            for i in range(n_calls):
                call(i % n)
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / n_calls * 1e6
            best[name] = min(us, best.get(name, us))
    return best


def time_eager_loop(case: Case, call, n_calls: int = 200, reps: int = 3) -> float:
    """:func:`time_eager_loops` of one call."""
    return time_eager_loops(case, {"call": call}, n_calls, reps)["call"]


def ceilings(device="cuda") -> dict:
    """Measured on this card: device-to-device copy (bytes read + written) and bf16 matmul."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: the ceilings are measured on a CUDA device, got {device}")
    x = torch.empty(int(2 ** 30), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median") * 1e-3
    copy = 2 * x.numel() / t / 1e9
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median") * 1e-3
    return {"copy_gbps": round(copy, 1), "matmul_tflops": round(2 * 8192 ** 3 / t / 1e12, 1)}


_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}
_TAIL_WORD = re.compile(r"^(\d+gb|sxm\d*|pcie|hbm\d*e?|nvl|mig|blackwell|ada|generation|server|workstation"
                        r"|edition|laptop|max|q)$")


def gpu_slug(name: str) -> str:
    """The folder a GPU's results go to: the model, without vendor, memory or form-factor words.

    "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100",
    "NVIDIA GeForce RTX 4090" -> "rtx-4090", "NVIDIA RTX 6000 Ada Generation" -> "rtx-6000".
    """
    out = []
    for w in re.split(r"[^a-z0-9]+", name.lower()):
        if not w or w in _VENDOR_WORDS:
            continue
        if _TAIL_WORD.match(w):
            break
        out.append(w)
    return "-".join(out) or "gpu"


def provenance(ceil: dict) -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        drv = "unknown"
    return {"gpu": props.name, "sm_count": props.multi_processor_count, "l2_mb": round(props.L2_cache_size / 2**20, 1),
            "driver": drv,
            "torch": torch.__version__, "triton": triton.__version__, "commit": code_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "ceilings": ceil, "mma_configs": _config_source(),
            **({"flashmla": flashmla_provenance()} if flash_mla is not None else {})}


def flashmla_provenance() -> dict:
    """Which FlashMLA ran: its version string, where it was imported from, and its build: the
    ``BUILD_INFO.json`` that ``scripts/build_flashmla.sh`` writes beside it (its commit, target,
    sources), else ``$FLASHMLA_COMMIT`` and ``$FLASHMLA_FLAGS``."""
    path = os.path.dirname(flash_mla.__file__)
    out = {"version": getattr(flash_mla, "__version__", "unknown"), "path": path,
           "commit": os.environ.get("FLASHMLA_COMMIT", "unknown"), "flags": os.environ.get("FLASHMLA_FLAGS", "")}
    info = os.path.join(path, "BUILD_INFO.json")
    if os.path.exists(info):
        with open(info) as f:
            build = json.load(f)
        out.update(commit=build.get("commit", out["commit"]), build=build)
    return out


def code_commit(cwd=None) -> str:
    """The commit a measurement's code is: ``$MLA_COMMIT`` if set, else the checkout's short HEAD,
    with ``+dirty`` when tracked files differ from it (a working tree timed before it was
    committed, or a copy whose git metadata is older than its files), else "unknown"."""
    if os.environ.get("MLA_COMMIT"):
        return os.environ["MLA_COMMIT"]
    cwd = cwd or pathlib.Path(__file__).parent
    try:
        git = functools.partial(subprocess.run, capture_output=True, text=True, cwd=cwd, timeout=30)
        head = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = git(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def _config_source() -> str:
    try:
        return configs.source()
    except Exception:  # noqa: BLE001
        return "unknown"


def record(s: Shape, impl: str, us_graph: float, us_do_bench: float | None, ceil: dict,
           us_eager_loop: float | None = None) -> dict:
    """One record: the CUDA-graph time per call, the eager figures (``us_do_bench``: the GPU time
    of a call alone; ``us_eager_loop``: a back-to-back loop's wall time per call), and the rates."""
    t = us_graph * 1e-6
    floor = max(traffic_bytes(s) / (ceil["copy_gbps"] * 1e9), flops(s) / (ceil["matmul_tflops"] * 1e12))

    def us(x):
        return None if x is None else round(x, 2)

    return {"shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "topk": s.topk, "extra_topk": s.extra_topk,
            "page": s.page, "extra_page": s.extra_page if s.extra_topk else None, "lengths": s.lengths, "impl": impl,
            "us_graph": round(us_graph, 2), "us_do_bench": us(us_do_bench), "us_eager_loop": us(us_eager_loop),
            "tflops": round(flops(s) / t / 1e12, 2), "gbps": round(traffic_bytes(s) / t / 1e9, 1),
            "roofline": round(floor / t, 4), **({"d_qk": s.d_qk} if s.d_qk != D_QK else {})}


#: impls that time the portable kernel as another architecture compiles it, and that architecture
PORTABLE_ISAS = {"tl_dot_sm80": 80, "tl_dot_sm89": 89}
#: the portable Gluon kernel (:mod:`mla.kernels.gluon_portable`): this GPU's code (0), or another
#: architecture's
GLUON_PORTABLE = {"gluon_portable": 0, "gluon_portable_sm80": 80, "gluon_portable_sm89": 89}
#: the Gluon kernel's 128-head form as a 2-CTA cluster (:mod:`mla.kernels.gluon_sm90.cluster`), forced
MMA_CLUSTER = "mma_cluster"
#: the impls timed as mla's tensor-core path is (a plan made once, 20 graph replays)
PLANNED = ("mma", "tl_dot", *PORTABLE_ISAS, *GLUON_PORTABLE, MMA_CLUSTER)
IMPL_NAMES = (*PLANNED, "simt", "reference", "flashmla")
#: what each impl stands for in the records: FlashMLA needs 64 or 128 heads, so at V4-TP8 (8
#: heads) a server pads to 64 and pays the V4-CSA time, which stands for FlashMLA there
FLASHMLA_HEADS = (64, 128)

#: The tolerance a rerun is judged by in :func:`compare`: |ratio - 1| <= SPREAD counts as "the same".
#: In the H200 record the three CUDA-graph timings of one shape in one run spread by about 1% in
#: the median and a little over 5% at worst, and a rerun on another lease lands within about 5%
#: (chapter 7 shows both): 5% is the edge of what one number can tell apart.
SPREAD = 0.05


def _refusal() -> str:
    why = "" if torch.cuda.is_available() else "; no CUDA GPU was found, so `import mla` turned it on"
    return ("mla.bench: refusing to run under Triton's CPU interpreter (TRITON_INTERPRET=1" + why + "): "
            "an interpreter timing means nothing. Run it on a machine with a CUDA GPU. Without one, the "
            "H200 record is results/h200/bench.json (chapter 7 draws it), and "
            "`python -m mla.bench --compare A.json B.json` compares two result files.")


def _progress_bar(total: int, enabled: bool):
    try:                              # a widget in a notebook only when ipywidgets is there
        import ipywidgets  # noqa: F401
        from tqdm.auto import tqdm
    except ImportError:
        from tqdm import tqdm
    return tqdm(total=total, disable=not enabled, desc="mla.bench", unit="case")


def available_impls() -> tuple:
    """The impls this machine can time: FlashMLA's only where its extension imports."""
    return tuple(i for i in IMPL_NAMES if i != "flashmla" or flash_mla is not None)


def run(shapes=None, impls=None, out_dir="results", name="bench", pool_bytes=2e9, n_sets=16,
        eager=True, progress=True, repeat=1) -> dict:
    """Run the protocol on this GPU and write ``<out_dir>/<gpu-slug>/<name>.json``.

    Per shape one :class:`Case` (a pool of ``pool_bytes`` per cache, ``n_sets`` index sets), then
    ``repeat`` rounds over the impls, one after another on the same inputs, of the CUDA-graph
    median per call (:func:`time_graph`): ``us_graph`` is the median of the rounds and
    ``us_graph_runs`` lists them. For ``mma`` and ``flashmla`` also the eager figures
    (:func:`time_do_bench`, and :func:`time_eager_loops`, their loops taking turns; ``mma`` with its
    plan, and without one as ``us_eager_loop_unplanned``). ``flashmla`` runs where h_q is 64 or 128 only. Returns the
    file's content plus ``path`` and, when a file was there before, ``previous`` (what it held:
    :func:`compare` it with the new one).
    """
    if _interpreting():
        raise RuntimeError(_refusal())
    if not torch.cuda.is_available():
        raise RuntimeError("mla.bench: no CUDA GPU found")
    shapes = list(spec_shapes() if shapes is None else shapes)
    impls = tuple(available_impls() if impls is None else impls)
    if not shapes or not impls:
        raise ValueError("mla.bench.run: nothing to time (no shapes or no impls)")
    unknown = set(impls) - set(IMPL_NAMES)
    if unknown:
        raise ValueError(f"impls: unknown {sorted(unknown)}; known: {IMPL_NAMES}")
    if "flashmla" in impls and flash_mla is None:
        raise RuntimeError("impl 'flashmla': the flash_mla extension does not import here")

    dev = torch.device("cuda")
    ceil = ceilings(dev)
    records = []
    bar = _progress_bar(len(shapes) * len(impls), progress)
    for s in shapes:
        bar.set_postfix_str(f"{s.name} b={s.b}: building the {pool_bytes / 1e9:g} GB pool")
        case = Case(s, dev, pool_bytes=pool_bytes, n_sets=n_sets)
        here = [i for i in impls if i != "flashmla" or s.h_q in FLASHMLA_HEADS]
        calls = {i: case.caller(i) for i in here}
        runs = {i: [] for i in here}
        for _ in range(max(1, repeat)):          # the impls alternate, round after round
            for i in here:
                runs[i].append(time_graph(case, calls[i], replays=20 if i in (*PLANNED, "flashmla") else 5))
        loops = {}
        if eager:                 # mma (with its plan and without) and FlashMLA: their loops take turns
            looped = {i: calls[i] for i in here if i in ("mma", "flashmla")}
            if "mma" in here:
                looped["mma-unplanned"] = case.caller("mma-unplanned")
            loops = time_eager_loops(case, looped)
        for i in here:
            fast = i in ("mma", "flashmla")
            rec = record(s, i, statistics.median(runs[i]), time_do_bench(case, calls[i]) if eager and fast else None,
                         ceil, loops.get(i))
            plan = getattr(calls[i], "plan", None)
            if plan is not None:                               # which kernel and form ran, on which schedule
                rec["kernel"] = plan.launch.config.label
                rec["programs"], rec["share"] = plan.launch.programs, plan.launch.share
            if i == "mma" and eager:
                rec["us_eager_loop_unplanned"] = round(loops["mma-unplanned"], 2)
            if len(runs[i]) > 1:
                rec["us_graph_runs"] = [round(x, 2) for x in runs[i]]
            records.append(rec)
            bar.update(1)
        bar.update(len(impls) - len(here))
        del case, calls
        torch.cuda.empty_cache()
    bar.close()
    result = {"provenance": provenance(ceil), "records": records}
    path = pathlib.Path(out_dir) / gpu_slug(result["provenance"]["gpu"]) / f"{name}.json"
    previous = None
    if path.exists():
        try:
            previous = json.loads(path.read_text())
        except ValueError:
            previous = None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    result["path"] = str(path)
    if previous is not None:
        result["previous"] = previous
    return result


# --------------------------------------------------------------------------------------------
# The sweep: FlashMLA beside mla over the shapes a server sends
# --------------------------------------------------------------------------------------------

#: the sweep's cache configs (issue "Fast at every shape a server sends"): DeepSeek's DSA, V4's
#: compressed (CSA) and heavily compressed (HCA-like) layers with their extra cache, and a long
#: top-k; HCA and long give ``topk_length`` (HCA also ``extra_topk_length``)
SWEEP_CONFIGS = {
    "DSA": dict(topk=2048, page=64),
    "CSA": dict(topk=128, page=256, extra_topk=512, extra_page=64),
    "HCA": dict(topk=128, page=256, extra_topk=1024, extra_page=2, lengths=True),
    "long": dict(topk=16384, page=64, lengths=True),
}
SWEEP_B = (1, 2, 8, 32, 64, 74, 128, 148, 256)
#: the long config's largest batch: b 256 at s_q 2 would gather 8.4M tokens a call
SWEEP_LONG_MAX_B = 148
SWEEP_IMPLS = ("mma", "tl_dot", *PORTABLE_ISAS, *GLUON_PORTABLE, "flashmla")


def sweep_shapes() -> list[Shape]:
    """The sweep's points, h_q 64 and 128 first (every config, s_q 1 and 2), then h_q 8, 16 and
    32 at the CSA config (FlashMLA padded to 64 heads there)."""
    out = []
    for h_q in (64, 128):
        for s_q in (1, 2):
            for name, cfg in SWEEP_CONFIGS.items():
                out += [Shape(f"sweep {name}", b, s_q, h_q, **cfg) for b in SWEEP_B
                        if name != "long" or b <= SWEEP_LONG_MAX_B]
    for h_q in (8, 16, 32):
        for s_q in (1, 2):
            out += [Shape("sweep CSA", b, s_q, h_q, **SWEEP_CONFIGS["CSA"]) for b in SWEEP_B]
    return out


#: DeepSeek-V3.2's part of the sweep: its cache (656-byte tokens, q 576 wide) at its top-k of 2048
#: over pages of 64, as FlashMLA's V3.2 cases have it (its sm_90 V3.2 kernel takes no extra cache
#: and no top-k lengths)
V32_SWEEP_CONFIG = dict(topk=2048, page=64, d_qk=576)


def v32_sweep_shapes() -> list[Shape]:
    """The V3.2 sweep's points: h_q 64 and 128, b over :data:`SWEEP_B`, s_q 1 and 2."""
    return [Shape("sweep V3.2", b, s_q, h_q, **V32_SWEEP_CONFIG) for h_q in (64, 128) for s_q in (1, 2)
            for b in SWEEP_B]


def _sweep_key(r: dict) -> tuple:
    return (r["shape"], r["b"], r["s_q"], r["h_q"], r["impl"])


def sweep(shapes=None, impls=SWEEP_IMPLS, out_dir="results", name="sweep", budget_s: float = 540.0,
          pool_bytes: float = 1e9, n_sets: int = 8, progress=True) -> dict:
    """Time ``impls`` at the sweep's points (:func:`sweep_shapes`) in one process, FlashMLA beside
    ``mla`` on the same inputs, and merge them into ``<out_dir>/<gpu-slug>/<name>.json``. Points
    already in the file are skipped, and no new point starts after ``budget_s`` seconds, so
    that the sweep runs in parts that each fit one device call: run it again until
    ``remaining`` is 0. Each part's provenance is kept under ``parts``; each record names its
    part. Caches are shared between the points of a page size (pools of ``pool_bytes``, far
    larger than the L2); each point has ``n_sets`` index sets in its graph. ``mma`` and
    ``flashmla`` also get the eager loop, their loops taking turns (:func:`time_eager_loops`)."""
    t0 = time.time()
    if _interpreting():
        raise RuntimeError(_refusal())
    if not torch.cuda.is_available():
        raise RuntimeError("mla.bench: no CUDA GPU found")
    impls = tuple(i for i in impls if i != "flashmla" or flash_mla is not None)
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    prov = provenance(ceil)
    path = pathlib.Path(out_dir) / gpu_slug(prov["gpu"]) / f"{name}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"parts": [], "records": []}
    part = len(doc["parts"])
    done = {_sweep_key(r) for r in doc["records"]}
    todo = [(s, [i for i in impls if (s.name, s.b, s.s_q, s.h_q, i) not in done])
            for s in (sweep_shapes() if shapes is None else shapes)]
    todo = [(s, i) for s, i in todo if i]
    pools = {}
    bar = _progress_bar(len(todo), progress)
    timed = 0
    doc["parts"].append({**prov, "points": 0})
    path.parent.mkdir(parents=True, exist_ok=True)

    def save():             # after every point: a part cut short keeps what it timed
        doc["parts"][-1].update(points=timed, seconds=round(time.time() - t0, 1))
        doc["provenance"] = doc["parts"][0] | {"parts": len(doc["parts"])}
        doc["remaining"] = len(todo) - timed
        path.write_text(json.dumps(doc, indent=1) + "\n")

    for s, here in todo:
        if time.time() - t0 > budget_s:
            break
        case = Case(s, dev, pool_bytes=pool_bytes, n_sets=n_sets, pools=pools)
        calls = {i: case.caller(i) for i in here}
        loops = time_eager_loops(case, {i: c for i, c in calls.items() if i in ("mma", "flashmla")})
        for i, call in calls.items():
            rec = record(s, i, time_graph(case, call), None, ceil, loops.get(i))
            rec["part"] = part
            if i == "flashmla" and s.h_q < FLASHMLA_HEADS[0]:
                rec["padded_to"] = FLASHMLA_HEADS[0]
            plan = getattr(call, "plan", None)
            if plan is not None:
                rec["kernel"] = plan.launch.config.label
                rec["programs"], rec["share"] = plan.launch.programs, plan.launch.share
            doc["records"].append(rec)
        timed += 1
        save()
        bar.update(1)
        del case
    bar.close()
    save()
    doc["path"] = str(path)
    return doc


def sweep_ratios(doc: dict, impl: str = "mma") -> list[dict]:
    """Per sweep point, ``impl``'s CUDA-graph time over FlashMLA's, timed in the same run
    (``padded``: FlashMLA's row says it ran padded to 64 heads, as it does below 64), with both
    eager loops where they were timed and the kernel form and programs the launch rule picked."""
    by = {_sweep_key(r): r for r in doc["records"]}
    out = []
    for (shape, b, s_q, h_q, i), r in by.items():
        f = by.get((shape, b, s_q, h_q, "flashmla"))
        if i == impl and f is not None:
            out.append({"config": shape.removeprefix("sweep "), "b": b, "s_q": s_q, "h_q": h_q,
                        "lengths": bool(r.get("lengths")), "us": r["us_graph"], "us_flashmla": f["us_graph"],
                        "ratio": r["us_graph"] / f["us_graph"], "padded": f.get("padded_to") is not None,
                        "eager": r.get("us_eager_loop"), "eager_flashmla": f.get("us_eager_loop"),
                        "kernel": r.get("kernel"), "programs": r.get("programs")})
    return out


def sweep_summary(doc: dict, impl: str = "mma") -> dict:
    """{h_q: (points, geometric mean ratio, worst ratio)} of :func:`sweep_ratios`."""
    rows = sweep_ratios(doc, impl)
    out = {}
    for h in sorted({r["h_q"] for r in rows}):
        xs = [r["ratio"] for r in rows if r["h_q"] == h]
        out[h] = (len(xs), math.exp(sum(map(math.log, xs)) / len(xs)), max(xs))
    return out


# --------------------------------------------------------------------------------------------
# The sparse prefill (FlashMLA's flash_mla_sparse_fwd), beside FlashMLA's where it imports
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillShape:
    """One point of the prefill's grid: every position valid, a sink per head, no topk_length
    (FlashMLA's performance cases)."""

    s_q: int
    s_kv: int
    h_q: int
    topk: int
    d_qk: int

    @property
    def name(self) -> str:
        return "prefill V3.2" if self.d_qk == 576 else "prefill V4"


#: "mma": mla's prefill as it ships (fp16 operands); "mma-bf16": with bf16 operands, FlashMLA's
#: rounding of P (:class:`mla.configs.PrefillConfig`'s ``dot``); "flashmla": FlashMLA's own
PREFILL_IMPLS = ("mma", "mma-bf16", "flashmla")


def prefill_shapes() -> list[PrefillShape]:
    """The prefill's grid (issue #53): h_q 64 and 128, d_qk 512 and 576, top-k 512, 1024 and
    2048, s_q 1024 and 4096, s_kv 8192 and 32768: 48 points, in the order of their FLOPs (the
    cheapest first), so that a time budget cuts the costliest."""
    grid = [PrefillShape(s_q, s_kv, h_q, topk, d_qk) for h_q in (64, 128) for d_qk in (512, 576)
            for s_q in (1024, 4096) for topk in (512, 1024, 2048) for s_kv in (8192, 32768)]
    return sorted(grid, key=prefill_flops)


def prefill_flops(s: PrefillShape) -> int:
    """2 * s_q * h_q * topk * (d_qk for Q.K^T + 512 for P.V), FlashMLA's count."""
    return 2 * s.s_q * s.h_q * s.topk * (s.d_qk + 512)


def prefill_bytes(s: PrefillShape) -> int:
    """Bytes that must move from DRAM at least: each kv row once (bf16, d_qk wide; queries share
    rows through L2, so gathering per query overcounts), the indices, q and out (bf16),
    max_logits and lse (fp32)."""
    rows = min(s.s_kv, s.s_q * s.topk)
    return rows * 2 * s.d_qk + s.s_q * s.topk * 4 + s.s_q * s.h_q * ((s.d_qk + 512) * 2 + 8)


def prefill_record(s: PrefillShape, impl: str, us_graph: float, us_do_bench: float | None, ceil: dict) -> dict:
    """One prefill record: the CUDA-graph and do_bench medians, TFLOP/s, GB/s and the roofline
    fraction against this card's measured ceilings."""
    t = us_graph * 1e-6
    floor = max(prefill_bytes(s) / (ceil["copy_gbps"] * 1e9), prefill_flops(s) / (ceil["matmul_tflops"] * 1e12))
    return {"shape": s.name, "s_q": s.s_q, "s_kv": s.s_kv, "h_q": s.h_q, "topk": s.topk, "d_qk": s.d_qk,
            "impl": impl, "us_graph": round(us_graph, 2),
            "us_do_bench": None if us_do_bench is None else round(us_do_bench, 2),
            "tflops": round(prefill_flops(s) / t / 1e12, 2), "gbps": round(prefill_bytes(s) / t / 1e9, 1),
            "roofline": round(floor / t, 4)}


def random_unique_indices(s_q: int, s_kv: int, topk: int, device, generator=None, rows: int = 256) -> torch.Tensor:
    """``[s_q, 1, topk]`` int32: for each query token ``topk`` distinct tokens of ``[0, s_kv)``
    in random order (as FlashMLA's test draws them), ``rows`` tokens at a time."""
    out = torch.empty(s_q, 1, topk, dtype=torch.int32, device=device)
    for lo in range(0, s_q, rows):
        hi = min(s_q, lo + rows)
        r = torch.rand(hi - lo, s_kv, device=device, generator=generator)
        out[lo:hi, 0] = r.topk(topk, dim=-1, sorted=False).indices.to(torch.int32)
    return out


class PrefillCase:
    """Inputs of one prefill point, drawn as FlashMLA's test draws them, with ``n_sets`` index
    sets (the CUDA graph holds one call per set)."""

    def __init__(self, s: PrefillShape, device, n_sets: int = 4, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.shape = s
        self.q = (torch.randn(s.s_q, s.h_q, s.d_qk, device=device, generator=g) / 10).bfloat16()
        self.kv = (torch.randn(s.s_kv, 1, s.d_qk, device=device, generator=g) / 10).bfloat16()
        self.sink = torch.randn(s.h_q, device=device, generator=g)
        self.index_sets = [random_unique_indices(s.s_q, s.s_kv, s.topk, device, g) for _ in range(n_sets)]
        self.sm_scale = s.d_qk ** -0.5

    def caller(self, impl: str):
        """``f(i)``: one call of ``impl`` (:data:`PREFILL_IMPLS`: :func:`mla.sparse_prefill`
        with the device's config, the same with bf16 operands, or FlashMLA's own
        ``flash_mla_sparse_fwd``) on index set ``i``."""
        if impl == "flashmla":
            if flash_mla is None:
                raise RuntimeError("impl 'flashmla': the flash_mla extension does not import here")
            fn = flash_mla.flash_mla_sparse_fwd
        elif impl in ("mma", "mma-bf16"):
            cfg = dispatch.prefill_config(self.q.device, self.shape.h_q)
            if impl == "mma-bf16":
                cfg = dataclasses.replace(cfg, dot="bfloat16")
            fn = functools.partial(api.sparse_prefill, config=cfg)
            fn.config = cfg
        else:
            raise ValueError(f"impl: expected one of {PREFILL_IMPLS}, got {impl!r}")
        call = lambda i: fn(self.q, self.kv, self.index_sets[i], self.sm_scale, 512, self.sink)  # noqa: E731
        call.config = getattr(fn, "config", None)
        return call


def prefill(shapes=None, impls=None, out_dir="results", name="prefill", budget_s: float = 150.0, n_sets: int = 4,
            progress=True) -> dict:
    """Time the sparse prefill at ``shapes`` (default :func:`prefill_shapes`) for ``impls``
    (:data:`PREFILL_IMPLS`; "flashmla" where its package imports), one after another on the same
    inputs: the CUDA-graph median per call over ``n_sets`` index sets (:func:`time_graph`) and
    do_bench's median (:func:`time_do_bench`), both after a warm-up; no point starts after
    ``budget_s`` seconds (``remaining`` counts those left). Writes
    ``<out_dir>/<gpu-slug>/<name>.json`` with the project's provenance. A FlashMLA call that
    fails (its extension runs on sm_90 and sm_100 only) is left out, with its error in
    ``skipped``."""
    t0 = time.time()
    if _interpreting():
        raise RuntimeError(_refusal())
    if not torch.cuda.is_available():
        raise RuntimeError("mla.bench: no CUDA GPU found")
    shapes = list(prefill_shapes() if shapes is None else shapes)
    impls = tuple(i for i in (PREFILL_IMPLS if impls is None else impls) if i != "flashmla" or flash_mla is not None)
    unknown = set(impls) - set(PREFILL_IMPLS)
    if unknown:
        raise ValueError(f"impls: unknown {sorted(unknown)}; known: {PREFILL_IMPLS}")
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    records, skipped, done = [], [], 0
    bar = _progress_bar(len(shapes), progress)
    for s in shapes:
        if time.time() - t0 > budget_s:
            break
        case = PrefillCase(s, dev, n_sets=n_sets)
        for impl in impls:
            call = case.caller(impl)
            try:
                rec = prefill_record(s, impl, time_graph(case, call), time_do_bench(case, call), ceil)
            except RuntimeError as e:          # FlashMLA off sm_90 / sm_100
                skipped.append({**dataclasses.asdict(s), "impl": impl, "error": str(e)[:300]})
                continue
            if call.config is not None:
                rec["config"] = dataclasses.asdict(call.config)
            records.append(rec)
        done += 1
        bar.update(1)
        del case
        torch.cuda.empty_cache()
    bar.close()
    result = {"provenance": provenance(ceil), "records": records, "skipped": skipped,
              "remaining": len(shapes) - done, "seconds": round(time.time() - t0, 1)}
    return write_result(result, out_dir, name)


def write_result(result: dict, out_dir, name: str) -> dict:
    """Write ``result`` (with its ``provenance``) to ``<out_dir>/<gpu-slug>/<name>.json``;
    returns it with ``path`` added."""
    path = pathlib.Path(out_dir) / gpu_slug(result["provenance"]["gpu"]) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    result["path"] = str(path)
    return result


def prefill_table(records) -> str:
    """Plain text of the prefill records: us per call (CUDA graph) per point and impl, and
    mla's time over FlashMLA's where both ran."""
    from rich.table import Table

    t = Table(title="sparse prefill, us per call (CUDA graph)")
    for col in ("d_qk", "h_q", "s_q", "topk", "s_kv", "impl", "us", "TFLOP/s", "GB/s", "/ FlashMLA"):
        t.add_column(col, justify="left" if col == "impl" else "right")
    by = {(r["d_qk"], r["h_q"], r["s_q"], r["topk"], r["s_kv"], r["impl"]): r for r in records}
    for (d, h, sq, k, skv, impl), r in by.items():
        f = by.get((d, h, sq, k, skv, "flashmla"))
        ratio = f"{r['us_graph'] / f['us_graph']:.2f}" if f is not None and impl != "flashmla" else ""
        t.add_row(str(d), str(h), str(sq), str(k), str(skv), impl, f"{r['us_graph']:.1f}", f"{r['tflops']:.0f}",
                  f"{r['gbps']:.0f}", ratio)
    con = _console(120)
    con.print(t)
    return con.export_text()


# --------------------------------------------------------------------------------------------
# The host's share of a call: Python before the launches, with the launches stubbed
# --------------------------------------------------------------------------------------------


class _NoCLauncher:
    """Stands for a compiled kernel's C launcher: ``launch(...)`` does nothing."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    @staticmethod
    def launch(*args):
        return None


class _NoCompiled(CompiledKernel):
    """Stands for a compiled kernel whose launches do nothing, so that a plan's calls take the
    direct launch (:class:`mla.dispatch.BoundLaunch`) as they do on a GPU."""

    module = None                   # CompiledKernel.__del__ unloads a module when it has one
    function, packed_metadata = 0, (8, 1, 0)

    def __init__(self):
        self._run = _NoCLauncher()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _NoLaunch:
    """Stands for a kernel: ``kernel[grid](...)`` does nothing and returns a compiled kernel
    whose launches do nothing."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _NoCompiled()


@contextlib.contextmanager
def _stubbed_launches(h200: bool):
    """Every kernel launch of ``mla`` a no-op for the block; with ``h200`` the launch rule plans
    as on an H200 (132 SMs, the shipped table, the Gluon kernel), on whatever device the tensors
    are."""
    saved = [(tl_dot, "tl_dot_decode_kernel"), (combine, "combine_kernel")]
    if dispatch.gluon_sm90 is not None:
        saved.append((dispatch.gluon_sm90.kernel, "gluon_decode_kernel"))
    saved = [(m, n, getattr(m, n)) for m, n in saved]
    facts = dispatch._facts
    try:
        for m, n, k in saved:
            setattr(m, n, _NoLaunch(k.fn))
        if h200:
            table = configs.table_for("NVIDIA H200", "3.6", 90)[1]
            dispatch._facts = lambda device: (132, table, dispatch.gluon_sm90 is not None, True)
        yield
    finally:
        for m, n, k in saved:
            setattr(m, n, k)
        dispatch._facts = facts


def host_cost(shapes=None, calls: int = 2000, reps: int = 5, h200: bool = True, device="cpu") -> list[dict]:
    """Microseconds of Python per call before its launches, with a plan and without one, at each
    shape (one-block caches: the host's work depends on the shapes only): the fastest of ``reps``
    rounds, each round a ``timeit`` loop of ``calls`` calls of every shape and variant in turn (the
    garbage collector off; the work is the same every call, so the fastest loop is the one the
    rest of the machine disturbed least, and a slow spell of the machine falls on every shape
    alike rather than on the shapes timed during it). The kernel launches are stubbed; with
    ``h200`` the launch rule plans as on an H200 whatever the device."""
    dev = torch.device(device)
    rows, loops = [], []
    with _stubbed_launches(h200):
        for s in spec_shapes() if shapes is None else shapes:
            q = torch.zeros(s.b, s.s_q, s.h_q, D_QK, dtype=torch.bfloat16, device=dev)
            kw = dict(attn_sink=torch.zeros(s.h_q, device=dev))
            cache = quantize_kv(torch.zeros(1, s.page, D_QK, dtype=torch.bfloat16, device=dev))
            idx = torch.zeros(s.b, s.s_q, s.topk, dtype=torch.int32, device=dev)
            if s.extra_topk:
                kw.update(extra_k_cache=quantize_kv(torch.zeros(1, s.extra_page, D_QK, dtype=torch.bfloat16,
                                                                device=dev)),
                          extra_indices=torch.zeros(s.b, s.s_q, s.extra_topk, dtype=torch.int32, device=dev))
            out = torch.empty_like(q)
            lse = torch.empty(s.b, s.h_q, s.s_q, device=dev)
            plan = api.plan(q, cache, idx, **kw, impl="mma")
            row = {"shape": s.name, "b": s.b, "launch": plan.launch.label}
            rows.append(row)
            loops.append((row, "us with a plan", functools.partial(
                api.sparse_decode, q, cache, idx, **kw, plan=plan, out=out, lse=lse)))
            loops.append((row, "us without a plan", functools.partial(api.sparse_decode, q, cache, idx, **kw,
                                                                       impl="mma")))
        for _, _, f in loops:
            f()
        for _ in range(reps):
            for row, what, f in loops:
                us = timeit.Timer(f).timeit(calls) / calls * 1e6
                row[what] = round(min(us, row.get(what, us)), 2)
    return rows


def _console(width: int):
    """A rich console that only records plain text (in a notebook too, where rich would otherwise
    display the table itself)."""
    from rich.console import Console

    return Console(file=io.StringIO(), width=width, record=True, force_jupyter=False, force_terminal=False,
                   color_system=None)


def flashmla_us(records) -> dict:
    """FlashMLA's CUDA-graph time per (shape, b) in these records; at V4-TP8 its padded time,
    the V4-CSA one (FlashMLA needs 64 heads)."""
    got = {(r["shape"], r["b"]): r["us_graph"] for r in records if r["impl"] == "flashmla"}
    for (name, b), us in list(got.items()):
        if name == "V4-CSA":
            got.setdefault(("V4-TP8", b), us)
    return got


def table(records, title="sparse decode, us per call (CUDA graph)") -> str:
    """A plain-text table of records (rich draws it), with FlashMLA's time from the same run when
    the records hold it (else the contract's H200 number, measured elsewhere) and the ratio."""
    from rich.table import Table

    same_run = flashmla_us(records)
    fm_all = same_run or FLASHMLA_H200_US
    t = Table(title=title)
    for col in ("shape", "b", "s_q", "h_q", "impl", "us_graph", "us_eager_loop", "TFLOP/s", "GB/s", "roofline",
                "FlashMLA us" + (" (this run)" if same_run else " (contract)"), "/ FlashMLA"):
        t.add_column(col, justify="right")
    for r in records:
        fm = fm_all.get((r["shape"], r["b"]))
        loop = r.get("us_eager_loop")
        t.add_row(r["shape"], str(r["b"]), str(r["s_q"]), str(r["h_q"]), r["impl"], f"{r['us_graph']:.1f}",
                  "-" if loop is None else f"{loop:.1f}", f"{r['tflops']:.1f}", f"{r['gbps']:.0f}",
                  f"{r['roofline']:.2f}", "-" if fm is None else f"{fm:.1f}",
                  "-" if fm is None else f"{r['us_graph'] / fm:.2f}")
    con = _console(170)   # export only: the caller prints
    con.print(t)
    return con.export_text()


def load(src) -> dict:
    """A result: a path to a JSON file, the dict itself, or a bare list of records."""
    if isinstance(src, (str, os.PathLike)):
        return json.loads(pathlib.Path(src).read_text())
    if isinstance(src, dict):
        return src
    return {"records": list(src)}


def _key(r: dict) -> tuple:
    return (r["shape"], r["b"], r["s_q"], r["h_q"], r["impl"])


def compare(record_a, record_b, tol: float = SPREAD) -> list[dict]:
    """Per (shape, b, s_q, h_q, impl) present in both results: ``ratio`` = us_graph of B / us_graph
    of A (above 1: B is slower), and ``within`` = |ratio - 1| <= tol. A and B are paths, result
    dicts or lists of records; the rows follow A's order."""
    b_by_key = {_key(r): r for r in load(record_b)["records"]}
    rows = []
    for ra in load(record_a)["records"]:
        rb = b_by_key.get(_key(ra))
        if rb is None or not ra.get("us_graph") or not rb.get("us_graph"):
            continue
        ratio = rb["us_graph"] / ra["us_graph"]
        rows.append({"shape": ra["shape"], "b": ra["b"], "s_q": ra["s_q"], "h_q": ra["h_q"], "impl": ra["impl"],
                     "us_a": ra["us_graph"], "us_b": rb["us_graph"], "ratio": round(ratio, 4),
                     "within": abs(ratio - 1) <= tol + 1e-9})
    return rows


def compare_table(rows, tol: float = SPREAD, names=("A", "B")) -> str:
    """Plain text of :func:`compare`'s rows, with the geometric mean and the worst ratio; ``names``
    says what A and B are (file names, say)."""
    from rich.table import Table

    t = Table(title=f"us per call (CUDA graph): B / A, where A = {names[0]}, B = {names[1]}")
    for col in ("shape", "b", "s_q", "h_q", "impl", "A us", "B us", "B / A", f"within {tol:.0%}"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["shape"], str(r["b"]), str(r["s_q"]), str(r["h_q"]), r["impl"], f"{r['us_a']:.1f}",
                  f"{r['us_b']:.1f}", f"{r['ratio']:.3f}", "yes" if r["within"] else "NO")
    con = _console(120)
    con.print(t)
    if rows:
        gm = math.exp(statistics.fmean(math.log(r["ratio"]) for r in rows))
        worst = max(rows, key=lambda r: abs(math.log(r["ratio"])))
        out = sum(not r["within"] for r in rows)
        con.print(f"{len(rows)} cases in both; geometric mean B / A = {gm:.3f}; worst {worst['ratio']:.3f} "
                  f"({worst['shape']} b={worst['b']} {worst['impl']}); {out} outside {tol:.0%}")
    else:
        con.print("no (shape, b, s_q, h_q, impl) in both results")
    return con.export_text()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def writer_bandwidth(rows=(64, 8192), pool_blocks: int = 4096, page: int = 64, reps: int = 50) -> list[dict]:
    """The cache writer on this GPU: for each number of rows, checks the bytes it writes against
    :func:`mla.quantize_kv` of the same rows, then times it (CUDA graph of ``reps`` calls over
    random slots of a pool, median of 5 replays) beside a plain copy of the same bytes (the rows
    read, their 584-byte tokens written, as one contiguous ``copy_``)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    cache = empty_cache(pool_blocks, page, device=dev, fill=0)
    out = []
    for n in rows:
        kv = torch.randn(n, D_QK, device=dev, generator=g).bfloat16()
        slots = torch.randperm(pool_blocks * page, device=dev, generator=g)[:n]
        api.write_kv(kv, cache, slots)
        got = token_bytes(cache, slots)
        want = token_bytes(quantize_kv(kv.view(n, 1, D_QK)), torch.arange(n, device=dev))
        src = torch.empty(n * (2 * D_QK + TOKEN_BYTES), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)

        def timed(fn):
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    fn()
            return replay_us(graph, reps, 5)

        us = timed(lambda: api.write_kv(kv, cache, slots))
        us_copy = timed(lambda: dst.copy_(src))
        moved = n * (2 * D_QK + TOKEN_BYTES)
        out.append({"rows": n, "bytes_ok": bool(torch.equal(got, want)), "us": round(us, 2),
                    "gbps": round(moved / us / 1e3, 1), "us_copy": round(us_copy, 2),
                    "gbps_copy": round(moved / us_copy / 1e3, 1)})
    return out


def combine_form(launch, n_q: int) -> str:
    """The combine's compiled form a launch runs, as :func:`mla.kernels.combine.launch_params`
    picks it: "" where no query is split, else "by query row" or "by share" for the work list,
    "per split" for uniform splits."""
    if not launch.combine:
        return ""
    kw = combine.launch_params(launch.programs, n_q, 1, False, launch.flat)[1]
    return ("by query row" if kw["BY_QUERY"] else "by share") if kw["FLAT"] else "per split"


def predicted_variants(shape_names=None, batches=range(1, 257), h200: bool = True) -> dict:
    """{shape name: the launches (decode config label, the combine's form, :func:`combine_form`)
    that a sweep of ``batches`` makes}, from the launch rule alone (as on an H200 with ``h200``).
    Each (label, whether it combines) is one compile of the decode (the schedule is not
    specialised on; the caches' strides and sizes are fixed per serving pool); each form of the
    combine is one compile of it, shared by every shape of a process (:func:`predicted_compiles`)."""
    names = shape_names or sorted({s.name for s in spec_shapes() if s.s_q == 1})
    if h200:
        table = configs.table_for("NVIDIA H200", "3.6", 90)[1]
        facts = (132, table, dispatch.gluon_sm90 is not None)
    out = {}
    for name in names:
        s0 = next(s for s in spec_shapes() if s.name == name)
        seen = set()
        for b in batches:
            if h200:
                cfg, programs, share = dispatch.decide(facts[1], facts[2], facts[0], b, s0.s_q, s0.h_q, s0.topk,
                                                       s0.extra_topk, 16)
                launch = dispatch.Launch(cfg, programs, share)
                launch = dataclasses.replace(launch, combine=dispatch.needs_combine(
                    launch, b * s0.s_q, s0.topk, s0.extra_topk, False))
            else:
                launch = dispatch.plan_launch(torch.device("cuda"), b, s0.s_q, s0.h_q, s0.topk, s0.extra_topk, 16)
            seen.add((launch.config.label, combine_form(launch, b * s0.s_q)))
        out[name] = sorted(seen)
    return out


def predicted_compiles(variants: dict) -> dict:
    """{shape name: kernels a process compiles for it} from :func:`predicted_variants`, in its
    order: the decode's (label, combines) pairs, plus each combine form no shape before it used
    (the combine does not depend on the caches, so a later shape reuses it)."""
    out, forms = {}, set()
    for name, launches in variants.items():
        new_forms = {f for _, f in launches if f} - forms
        out[name] = len({(label, bool(f)) for label, f in launches}) + len(new_forms)
        forms |= new_forms
    return out


def count_compiles(shape_names=None, batches=range(1, 257), pool_bytes=2e8) -> dict:
    """{shape name: kernels Triton compiled} over a sweep of ``batches`` (one call each, a plan
    made per batch size as a serving loop's graph warm-up would), measured from the kernels'
    caches on this GPU."""
    kernels = [tl_dot.tl_dot_decode_kernel, combine.combine_kernel]
    if dispatch.gluon_sm90 is not None:
        kernels.append(dispatch.gluon_sm90.gluon_decode_kernel)

    def compiled():
        n = 0
        for k in kernels:
            for cache in getattr(k, "device_caches", {}).values():
                n += len(cache[0])
        return n

    dev = torch.device("cuda")
    out = {}
    for name in shape_names or sorted({s.name for s in spec_shapes() if s.s_q == 1}):
        s0 = next(s for s in spec_shapes() if s.name == name)
        case = Case(Shape(name, max(batches), 1, s0.h_q, s0.topk, s0.page, s0.extra_topk, s0.extra_page), dev,
                    pool_bytes=pool_bytes, n_sets=1)
        before = compiled()
        for b in batches:
            kw = {k: (v[:b] if k == "extra_indices" else v) for k, v in case.kwargs(0).items()}
            api.sparse_decode(case.q[:b], case.cache, case.index_sets[0][:b], **kw)
        torch.cuda.synchronize()
        out[name] = compiled() - before
        del case
    return out


def serving_record(out_dir="results", name="serving") -> dict:
    """The serving figures on this GPU, written to ``<out_dir>/<gpu-slug>/<name>.json`` with
    their provenance: the writer's correctness and bandwidth against a plain copy
    (:func:`writer_bandwidth`), the kernels a sweep of b = 1..256 compiles (predicted from the
    launch rule and measured, :func:`count_compiles`), and the host's Python per call
    (:func:`host_cost`, the launches stubbed, on this machine's CPU)."""
    dev = torch.device("cuda")
    result = {"provenance": provenance(ceilings(dev)), "writer": writer_bandwidth(),
              "compiles": {"predicted": {k: [list(x) for x in v] for k, v in predicted_variants(h200=False).items()},
                           "measured": count_compiles()},
              "host": host_cost(h200=False, device=dev)}
    return write_result(result, out_dir, name)


def host_table(rows) -> str:
    """Plain text of :func:`host_cost`'s rows."""
    from rich.table import Table

    t = Table(title="Python per call before the launches (launches stubbed), us")
    for col in ("shape", "b", "launch", "with a plan", "without a plan"):
        t.add_column(col, justify="left" if col in ("shape", "launch") else "right")
    for r in rows:
        t.add_row(r["shape"], str(r["b"]), r["launch"], f"{r['us with a plan']:.1f}", f"{r['us without a plan']:.1f}")
    con = _console(120)
    con.print(t)
    return con.export_text()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", action="append", choices=IMPL_NAMES,
                    help="impls to time (default: every one this machine has; flashmla where it imports)")
    ap.add_argument("--shape", action="append",
                    help="only SPEC shapes with this name: DSA, 'DSA s_q 2', V4-CSA, V4-TP8 (repeatable)")
    ap.add_argument("--b", action="append", type=int, help="only these batch sizes (repeatable)")
    ap.add_argument("--out", default="results", help="results folder (default: results)")
    ap.add_argument("--name", default="bench", help="file name, without .json (default: bench)")
    ap.add_argument("--pool-gb", type=float, default=2.0, help="KV pool size per cache, GB (default 2)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time each CUDA graph this many times (a fresh graph each) and keep the median; "
                         "the runs go to us_graph_runs (default 1)")
    ap.add_argument("--no-eager", action="store_true",
                    help="skip the eager timings (us_do_bench and us_eager_loop)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--against", metavar="A.json",
                    help="after the run, compare the new file with this one (default: the file the run "
                         "replaced, if there was one)")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                    help="only compare two result files (B over A) and exit: 0 if every case is within "
                         "--tol, 1 if not; needs no GPU")
    ap.add_argument("--tol", type=float, default=SPREAD, help=f"tolerance of a comparison (default {SPREAD})")
    ap.add_argument("--serving", action="store_true",
                    help="only record the serving figures on this GPU (the writer's bandwidth and bytes, the kernels a "
                         "b = 1..256 sweep compiles, the host's Python per call) to <out>/<gpu-slug>/serving.json")
    ap.add_argument("--compiles", action="store_true",
                    help="only count the kernels a sweep of b = 1..256 compiles at each shape: predicted from the launch "
                         "rule (as on an H200), and measured on this GPU when there is one")
    ap.add_argument("--sweep", action="store_true",
                    help="time the sweep's impls (--impl to choose) over its grid into <out>/<gpu-slug>/sweep.json, "
                         "in parts: points already there are skipped and none starts after --budget-s; run it "
                         "again until it reports 0 remaining")
    ap.add_argument("--h-q", action="append", type=int, dest="h_q",
                    help="with --sweep: only the points of these head counts (repeatable)")
    ap.add_argument("--v32", action="store_true",
                    help="with --sweep: DeepSeek-V3.2's cache (v32_sweep_shapes) into <out>/<gpu-slug>/sweep_v32.json")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="the sweep's seconds per part (default 540); the prefill's seconds in all (default 150)")
    ap.add_argument("--prefill", action="store_true",
                    help="time the sparse prefill (mla.sparse_prefill, and FlashMLA's flash_mla_sparse_fwd where it "
                         "imports) over h_q 64/128, d_qk 512/576, top-k 512/1024/2048, s_q 1024/4096, s_kv "
                         "8192/32768 into <out>/<gpu-slug>/prefill.json; no point starts after --budget-s")
    ap.add_argument("--host", action="store_true",
                    help="only measure the Python per call before the launches (launches stubbed, the launch "
                         "rule planning as on an H200), with a plan and without one; needs no GPU")
    a = ap.parse_args(argv)
    if a.serving:
        if _interpreting() or not torch.cuda.is_available():
            print(_refusal(), file=sys.stderr)
            return 2
        res = serving_record(a.out)
        print(json.dumps({k: res[k] for k in ("writer", "compiles")}, indent=1))
        print(host_table(res["host"]))
        print(f"wrote {res['path']}")
        return 0
    if a.compiles:
        variants = predicted_variants(a.shape)
        for name, n in predicted_compiles(variants).items():
            print(f"{name}: {n} kernels over b = 1..256 (predicted, as on an H200): "
                  + "; ".join(f"{lab}{f', combine {form}' if form else ''}" for lab, form in variants[name]))
        if torch.cuda.is_available() and not _interpreting():
            for name, n in count_compiles(a.shape).items():
                print(f"{name}: {n} kernels compiled over b = 1..256 on {torch.cuda.get_device_name()} (measured)")
        return 0
    if a.sweep:
        try:
            grid = v32_sweep_shapes() if a.v32 else sweep_shapes()
            shapes = [s for s in grid if s.h_q in a.h_q] if a.h_q else grid
            impls = tuple(a.impl) if a.impl else (("mma", "flashmla") if a.v32 else SWEEP_IMPLS)
            doc = sweep(shapes, impls=impls, out_dir=a.out, name="sweep_v32" if a.v32 else "sweep",
                        budget_s=540.0 if a.budget_s is None else a.budget_s, progress=not a.no_progress)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 2
        for impl in PLANNED:
            for h, (n, gm, worst) in sweep_summary(doc, impl).items():
                print(f"{impl} h_q {h}: {n} points, geometric mean {gm:.2f}x FlashMLA, worst {worst:.2f}x")
        print(f"wrote {doc['path']} ({doc['remaining']} points remaining)")
        return 0
    if a.prefill:
        if _interpreting() or not torch.cuda.is_available():
            print(_refusal(), file=sys.stderr)
            return 2
        impls = tuple(i for i in (a.impl or PREFILL_IMPLS) if i in PREFILL_IMPLS)
        res = prefill(impls=impls, out_dir=a.out, budget_s=150.0 if a.budget_s is None else a.budget_s,
                      progress=not a.no_progress)
        print(prefill_table(res["records"]))
        print(f"wrote {res['path']} ({res['remaining']} points remaining, {len(res['skipped'])} calls skipped)")
        return 0
    if a.host:
        shapes = [s for s in spec_shapes() if (not a.shape or s.name in a.shape) and (not a.b or s.b in a.b)]
        print(host_table(host_cost(shapes)))
        return 0
    if a.compare:
        try:
            rows = compare(*a.compare, tol=a.tol)
        except (OSError, ValueError, KeyError) as e:
            print(f"mla.bench --compare: {e}", file=sys.stderr)
            return 2
        print(compare_table(rows, a.tol, names=tuple(a.compare)))
        if not rows:
            return 2
        return 0 if all(r["within"] for r in rows) else 1
    names = sorted({s.name for s in spec_shapes()})
    unknown = sorted(set(a.shape or ()) - set(names))
    if unknown:
        print(f"mla.bench: unknown shape {unknown}; the SPEC's shapes are {names}", file=sys.stderr)
        return 2
    shapes = [s for s in spec_shapes() if (not a.shape or s.name in a.shape) and (not a.b or s.b in a.b)]
    if not shapes:
        print(f"mla.bench: no SPEC shape matches --shape {a.shape} --b {a.b}", file=sys.stderr)
        return 2
    if _interpreting():
        print(_refusal(), file=sys.stderr)
        return 2
    try:
        res = run(shapes, tuple(a.impl) if a.impl else None, a.out, a.name, a.pool_gb * 1e9, eager=not a.no_eager,
                  progress=not a.no_progress, repeat=a.repeat)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    print(table(res["records"]))
    prov = res["provenance"]
    print(f"{prov['gpu']} ({prov['sm_count']} SMs), copy {prov['ceilings']['copy_gbps']:.0f} GB/s, "
          f"bf16 matmul {prov['ceilings']['matmul_tflops']:.0f} TFLOP/s; mma configs: {prov.get('mma_configs')}")
    print(f"wrote {res['path']}")
    if res.get("previous") is not None:
        lost = {_key(r) for r in res["previous"].get("records", [])} - {_key(r) for r in res["records"]}
        if lost:
            print(f"note: the file this run replaced held {len(lost)} cases this run did not time; they are "
                  "gone from it (git restores a committed record; --out or --name writes elsewhere)")
    base, base_name = (a.against, a.against) if a.against else (res.get("previous"), "replaced file")
    if base is not None:
        print(compare_table(compare(base, res, tol=a.tol), a.tol, names=(base_name, "this run")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
