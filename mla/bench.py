"""Benchmark protocol of the SPEC: ceilings, shapes, CUDA-graph and eager timing, JSON records.

``python -m mla.bench`` runs the SPEC's shapes for each impl on the GPU it finds and writes
``results/<gpu-slug>/<name>.json``. It refuses to run under the CPU interpreter: an interpreter
timing means nothing.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
from dataclasses import dataclass

import torch

from .layout import D_QK, TOKEN_BYTES, page_stride


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

    @property
    def topk_total(self) -> int:
        return self.topk + self.extra_topk


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


def traffic_bytes(s: Shape) -> int:
    """Bytes that must move: gathered tokens * 584 + indices + q + out + lse."""
    n_q = s.b * s.s_q
    return (n_q * s.topk_total * (TOKEN_BYTES + 4) + n_q * s.h_q * D_QK * 2 * 2 + n_q * s.h_q * 4)


def flops(s: Shape) -> int:
    """2 * b * s_q * h_q * topk_total * (512 for Q.K + 512 for P.V)."""
    return 2 * s.b * s.s_q * s.h_q * s.topk_total * 2 * D_QK


def random_cache(num_blocks: int, page: int, device, generator=None, chunk_tokens: int = 1 << 20) -> torch.Tensor:
    """A MODEL1 cache holding :func:`mla.quantize_kv` of N(0, 1) latents, as FlashMLA's tests use,
    quantized in chunks so that multi-GB pools fit in memory."""
    from .layout import empty_cache, quantize_kv

    cache = empty_cache(num_blocks, page, device=device, fill=0)
    ps = page_stride(page)
    flat = torch.as_strided(cache.view(torch.uint8), (num_blocks, ps), (cache.stride(0), 1))
    step = max(1, chunk_tokens // page)
    for lo in range(0, num_blocks, step):
        hi = min(num_blocks, lo + step)
        kv = torch.randn(hi - lo, page, D_QK, device=device, generator=generator).bfloat16()
        flat[lo:hi] = torch.as_strided(quantize_kv(kv).view(torch.uint8), (hi - lo, ps), (ps, 1))
    return cache


def random_indices(b, s_q, topk, n_tokens, device, generator=None) -> torch.Tensor:
    """Random token indices in [0, n_tokens). Drawn with replacement: over a pool of millions of
    tokens a query repeats a token with probability about topk/n_tokens (well under 0.1%)."""
    return torch.randint(0, n_tokens, (b, s_q, topk), dtype=torch.int32, device=device, generator=generator)


class Case:
    """Inputs of one shape over pools far larger than L2, with several index sets."""

    def __init__(self, s: Shape, device, pool_bytes: float = 2e9, n_sets: int = 16, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.shape = s
        nb = max(1, int(pool_bytes // page_stride(s.page)))
        self.cache = random_cache(nb, s.page, device, g)
        self.q = torch.randn(s.b, s.s_q, s.h_q, D_QK, device=device, generator=g).bfloat16()
        self.sink = torch.randn(s.h_q, device=device, generator=g)
        n = nb * s.page
        self.index_sets = [random_indices(s.b, s.s_q, s.topk, n, device, g) for _ in range(n_sets)]
        self.extra = None
        self.extra_sets = [None] * n_sets
        if s.extra_topk:
            enb = max(1, int(pool_bytes // 2 // page_stride(s.extra_page)))
            self.extra = random_cache(enb, s.extra_page, device, g)
            self.extra_sets = [random_indices(s.b, s.s_q, s.extra_topk, enb * s.extra_page, device, g)
                               for _ in range(n_sets)]

    def kwargs(self, i: int = 0) -> dict:
        kw = dict(attn_sink=self.sink)
        if self.extra is not None:
            kw.update(extra_k_cache=self.extra, extra_indices=self.extra_sets[i])
        return kw

    def call(self, fn, i: int = 0):
        return fn(self.q, self.cache, self.index_sets[i], **self.kwargs(i))


def time_graph(case: Case, fn, replays: int = 20) -> float:
    """Median us per call of a CUDA graph holding one call per index set, replayed."""
    n = len(case.index_sets)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n):          # warm-up: compile and allocate outside the capture
            case.call(fn, i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            case.call(fn, i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    del g
    return statistics.median(times)


def time_eager(case: Case, fn) -> float:
    """triton.testing.do_bench median, us, one index set after another."""
    import triton

    it = iter(range(10 ** 9))
    return triton.testing.do_bench(lambda: case.call(fn, next(it) % len(case.index_sets)),
                                   warmup=25, rep=100, return_mode="median") * 1e3


def ceilings(device=None) -> dict:
    """Measured on this card: device-to-device copy (bytes read + written) and bf16 matmul."""
    import triton

    x = torch.empty(int(2 ** 30), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median") * 1e-3
    copy = 2 * x.numel() / t / 1e9
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median") * 1e-3
    return {"copy_gbps": round(copy, 1), "matmul_tflops": round(2 * 8192 ** 3 / t / 1e12, 1)}


def gpu_slug(name: str) -> str:
    n = name.lower().replace("nvidia", "").strip()
    return "".join(ch if ch.isalnum() else "-" for ch in n).strip("-").split("-")[0] or "gpu"


def provenance(ceil: dict) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        drv = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=pathlib.Path(__file__).parent, timeout=30).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        commit = "unknown"
    commit = os.environ.get("MLA_COMMIT", commit)
    return {"gpu": props.name, "sm_count": props.multi_processor_count, "driver": drv,
            "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "ceilings": ceil, "mma_configs": _config_source()}


def _config_source() -> str:
    from . import configs

    try:
        return configs.source()
    except Exception:  # noqa: BLE001
        return "unknown"


def record(s: Shape, impl: str, us_graph: float, us_eager: float | None, ceil: dict) -> dict:
    t = us_graph * 1e-6
    floor = max(traffic_bytes(s) / (ceil["copy_gbps"] * 1e9), flops(s) / (ceil["matmul_tflops"] * 1e12))
    return {"shape": s.name, "b": s.b, "s_q": s.s_q, "h_q": s.h_q, "topk": s.topk, "extra_topk": s.extra_topk,
            "page": s.page, "extra_page": s.extra_page if s.extra_topk else None, "impl": impl,
            "us_graph": round(us_graph, 2), "us_eager": None if us_eager is None else round(us_eager, 2),
            "tflops": round(flops(s) / t / 1e12, 2), "gbps": round(traffic_bytes(s) / t / 1e9, 1),
            "roofline": round(floor / t, 4)}


IMPL_NAMES = ("mma", "simt", "reference")


def run(shapes=None, impls=IMPL_NAMES, out_dir="results", name="bench", pool_bytes=2e9, n_sets=16,
        eager=True, progress=True) -> dict:
    """Run the protocol on this GPU and write ``<out_dir>/<gpu-slug>/<name>.json``."""
    import mla

    if _interpreting():
        raise RuntimeError("mla.bench: refusing to time under Triton's CPU interpreter "
                           "(TRITON_INTERPRET=1): an interpreter timing means nothing. Run it on a CUDA GPU.")
    if not torch.cuda.is_available():
        raise RuntimeError("mla.bench: no CUDA GPU found")
    from tqdm.auto import tqdm

    dev = torch.device("cuda")
    shapes = list(shapes or spec_shapes())
    ceil = ceilings(dev)
    records = []
    bar = tqdm(total=len(shapes) * len(impls), disable=not progress, desc="mla.bench")
    for s in shapes:
        case = Case(s, dev, pool_bytes=pool_bytes, n_sets=n_sets)
        for impl in impls:
            fn = lambda *a, _i=impl, **k: mla.sparse_decode(*a, **k, impl=_i)  # noqa: E731
            slow = impl != "mma"
            us_g = time_graph(case, fn, replays=5 if slow else 20)
            us_e = time_eager(case, fn) if eager and not slow else None
            records.append(record(s, impl, us_g, us_e, ceil))
            bar.update(1)
        del case
        torch.cuda.empty_cache()
    bar.close()
    result = {"provenance": provenance(ceil), "records": records}
    path = pathlib.Path(out_dir) / gpu_slug(result["provenance"]["gpu"]) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    result["path"] = str(path)
    return result


def table(records) -> str:
    """A plain-text table of records (rich renders it in a notebook or terminal)."""
    from rich.table import Table
    from rich.console import Console

    t = Table(title="sparse decode, us per call (CUDA graph)")
    for col in ("shape", "b", "s_q", "h_q", "impl", "us_graph", "us_eager", "TFLOP/s", "GB/s", "roofline", "FlashMLA us"):
        t.add_column(col, justify="right")
    for r in records:
        fm = FLASHMLA_H200_US.get((r["shape"], r["b"]))
        t.add_row(r["shape"], str(r["b"]), str(r["s_q"]), str(r["h_q"]), r["impl"], f"{r['us_graph']:.1f}",
                  "-" if r["us_eager"] is None else f"{r['us_eager']:.1f}", f"{r['tflops']:.1f}",
                  f"{r['gbps']:.0f}", f"{r['roofline']:.2f}", "-" if fm is None else f"{fm}")
    con = Console(width=160, record=True)
    con.print(t)
    return con.export_text()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mla.bench", description=__doc__)
    ap.add_argument("--impl", action="append", choices=IMPL_NAMES, help="impls to time (default: all)")
    ap.add_argument("--shape", action="append", help="only SPEC shapes with this name (e.g. DSA, V4-CSA)")
    ap.add_argument("--b", action="append", type=int, help="only these batch sizes")
    ap.add_argument("--out", default="results", help="results folder (default: results)")
    ap.add_argument("--name", default="bench", help="file name (default: bench)")
    ap.add_argument("--pool-gb", type=float, default=2.0, help="KV pool size per cache, GB (default 2)")
    ap.add_argument("--no-eager", action="store_true", help="skip the do_bench eager timing")
    a = ap.parse_args(argv)
    shapes = [s for s in spec_shapes() if (not a.shape or s.name in a.shape) and (not a.b or s.b in a.b)]
    try:
        res = run(shapes, tuple(a.impl or IMPL_NAMES), a.out, a.name, a.pool_gb * 1e9, eager=not a.no_eager)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    print(table(res["records"]))
    print(f"wrote {res['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
