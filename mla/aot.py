"""Ahead-of-time compilation of the kernels for a GPU architecture, on any machine (no GPU).

``triton.compile`` with a ``GPUTarget`` needs no GPU, only Triton's bundled ptxas. It must run
with TRITON_INTERPRET=0 set before Triton is imported (an interpreted kernel cannot be
compiled), so :func:`report` runs the compile in a fresh Python process.

Shared memory per block by architecture (the SPEC's limits; a shipped config must fit):
sm_80 163 KB, sm_89 and sm_120 99 KB, sm_90 and sm_100 227 KB.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from . import configs, dispatch
from .configs import GLUON_FORMS, SMEM_LIMIT
from .kernels import combine, prefill, simt, tl_dot
from .layout import MODEL1, V32

ARCHS = tuple(SMEM_LIMIT)

# Argument types of the decode kernels, by name (pointer element types and scalars).
_DECODE_TYPES = {
    "q_ptr": "*bf16", "q_sb": "i32", "q_ss": "i32", "q_sh": "i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
    "sink_ptr": "*fp32", "sink_stride": "i32", "po_ptr": "*fp16", "plse_ptr": "*fp32", "rec_ptr": "*i32",
    "kc_ptr": "*u8", "kc_stride": "i32", "kc_P": "i32", "kc_n": "i32", "idx_ptr": "*i32", "idx_sb": "i32",
    "idx_ss": "i32", "topk": "i32", "len_ptr": "*i32", "len_stride": "i32", "ec_ptr": "*u8", "ec_stride": "i32",
    "ec_P": "i32", "ec_n": "i32", "eidx_ptr": "*i32", "eidx_sb": "i32", "eidx_ss": "i32", "etopk": "i32",
    "elen_ptr": "*i32", "elen_stride": "i32", "n_q": "i32", "s_q": "i32", "h_q": "i32", "sm_scale_log2": "fp32",
    "share": "i32", "num_programs": "i32", "num_splits": "i32",
}
# and of the sparse prefill kernel (:mod:`mla.kernels.prefill`)
_PREFILL_TYPES = {
    "q_ptr": "*bf16", "q_ss": "i32", "q_sh": "i32", "kv_ptr": "*bf16", "kv_ss": "i32", "idx_ptr": "*i32",
    "idx_ss": "i32", "len_ptr": "*i32", "len_stride": "i32", "sink_ptr": "*fp32", "sink_stride": "i32",
    "out_ptr": "*bf16", "out_ss": "i32", "out_sh": "i32", "max_ptr": "*fp32", "lse_ptr": "*fp32", "s_kv": "i32",
    "topk": "i32", "h_q": "i32", "sm_scale_log2": "fp32",
}
_ALIGNED = {"q_ptr", "out_ptr", "lse_ptr", "sink_ptr", "po_ptr", "plse_ptr", "rec_ptr", "kc_ptr", "idx_ptr",
            "len_ptr", "ec_ptr", "eidx_ptr", "elen_ptr", "kc_stride", "ec_stride", "q_sb", "q_ss", "q_sh",
            "idx_sb", "idx_ss", "eidx_sb", "eidx_ss", "kv_ptr", "kv_ss", "out_ss", "out_sh", "max_ptr"}


def _kernel(name: str):
    """(kernel, whether it is a Gluon source) by name."""
    if name == "gluon_decode_kernel":
        from .kernels.gluon_sm90 import gluon_decode_kernel

        return gluon_decode_kernel, True
    if name == "gluon_portable_kernel":
        from .kernels.gluon_portable import gluon_portable_kernel

        return gluon_portable_kernel, True
    if name == "gluon_cluster_kernel":
        from .kernels.gluon_sm90.cluster import gluon_cluster_kernel

        return gluon_cluster_kernel, True
    return {"tl_dot_decode_kernel": tl_dot.tl_dot_decode_kernel, "simt_decode_kernel": simt.simt_decode_kernel,
            "combine_kernel": combine.combine_kernel, "sparse_prefill_kernel": prefill.sparse_prefill_kernel}[name], False


def _compile_in_process(kernel_name: str, arch: int, constexprs: dict, num_warps: int, num_stages: int,
                        want_asm: tuple = (), types: dict | None = None, maxnreg: int = 0,
                        loops: bool = False, num_ctas: int = 1) -> dict:
    """Compile one kernel variant (this process must have TRITON_INTERPRET unset or 0);
    ``num_ctas`` CTAs a cluster."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, is_gluon = _kernel(kernel_name)
    if is_gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: F811
    sig, attrs = {}, {}
    constexprs = dict(constexprs)
    all_types = {**(_PREFILL_TYPES if kernel_name == "sparse_prefill_kernel" else _DECODE_TYPES), **(types or {})}
    for i, name in enumerate(kernel.arg_names):      # constexprs left out take their defaults
        if name not in constexprs and name not in all_types:
            constexprs[name] = kernel.params[i].default
    # A Gluon variant with ALIGN 8 is for page strides that are multiples of 8, not of 16 (odd P, contiguous).
    aligned = _ALIGNED - ({"kc_stride", "ec_stride"} if constexprs.get("ALIGN") == 8 else set())
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = all_types[name]
            if name in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    consts = dict(constexprs)
    if "DOT" in consts and isinstance(consts["DOT"], str):
        consts["DOT"] = getattr(triton.language, consts["DOT"])
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    if num_ctas > 1:
        options["num_ctas"] = num_ctas
    ck = triton.compile(src, target=target, options=options)
    res = {"arch": arch, "shared": int(ck.metadata.shared), "num_warps": num_warps, "num_stages": num_stages}
    ptx = ck.asm["ptx"]
    regs, spill, sass = _ptxas_usage(ptx, arch, want_sass=loops)
    # A kernel the backend could not lower is emitted as a lone `trap;` (seen on sm_100 when the
    # accumulators exceed tensor memory): it "fits" but would fault on launch.
    res.update(regs=regs, spill_bytes=spill, usable="ld.global" in ptx)
    if loops:
        res["loops"] = sass_loops(sass) if sass else None
    for k in want_asm:
        res[k] = ck.asm[k] if isinstance(ck.asm[k], str) else None
    return res


def _ptxas_usage(ptx: str, arch: int, want_sass: bool = False) -> tuple[int, int, str | None]:
    """Registers per thread and spill bytes, from the bundled ptxas' -v report; with
    ``want_sass`` also the SASS of the assembled kernel (nvdisasm, next to ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(arch)
    ptxas = tool.path if hasattr(tool, "path") else tool[0]
    m = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)      # e.g. sm_90a, sm_120a
    sm = m.group(1) if m else f"sm_{arch}"
    sass = None
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        cubin = os.path.join(d, "k.cubin")
        out = subprocess.run([ptxas, "-v", f"-arch={sm}", p, "-o", cubin], capture_output=True, text=True)
        if want_sass and out.returncode == 0:
            nvdisasm = os.path.join(os.path.dirname(ptxas), "nvdisasm")
            dis = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True)
            sass = dis.stdout if dis.returncode == 0 else None
    txt = out.stdout + out.stderr
    regs = re.findall(r"Used (\d+) registers", txt)
    spill = re.findall(r"(\d+) bytes spill stores", txt)
    return (int(regs[-1]) if regs else -1, int(spill[-1]) if spill else 0, sass)


#: SASS opcodes that run on the tensor cores (Hopper's warpgroup HGMMA, the warp-level HMMA).
TENSOR_OPS = ("HGMMA", "HMMA")


def sass_loops(sass: str) -> list[dict]:
    """The innermost loops of a SASS listing that issue tensor-core instructions (the token-tile
    loops of the decode kernel), in program order. A loop is a branch back to an earlier label;
    one that encloses another loop is left out (a warp-specialized kernel's mbarrier spin-waits
    are placed out of line and branch back over whole partitions). Each comes with its
    instruction count per iteration (per warp), its tensor-core instructions, its spill
    traffic (``LDL`` and ``STL``, loads and stores of local memory, which is where ptxas puts
    the registers it could not keep), its CTA barriers (``BAR``), and a cluster kernel's
    exchange: cluster barriers (``UCGABAR_WAIT``) and stores into a cluster's shared memory
    (``STAS``, st.async)."""
    labels, ins = {}, []
    for line in sass.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(.*)", line)
        if m:
            ins.append((m.group(1), m.group(2)))
    spans = []
    for i, (op, rest) in enumerate(ins):
        m = re.search(r"`\((\.L_x_\d+)\)", rest) if op == "BRA" else None
        if m and labels.get(m.group(1), i) < i:
            spans.append((labels[m.group(1)], i))
    loops = []
    for lo, hi in spans:
        if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans):
            continue
        body = [o for o, _ in ins[lo:hi + 1]]
        tensor = sum(body.count(t) for t in TENSOR_OPS)
        if tensor:
            loops.append({"instructions": len(body), "tensor_core": tensor,
                          "spill_loads": body.count("LDL"), "spill_stores": body.count("STL"),
                          "cta_barriers": body.count("BAR"), "cluster_barriers": body.count("UCGABAR_WAIT"),
                          "cluster_stores": body.count("STAS")})
    return loops


def report(variants: list[dict], timeout: int = 1800) -> list[dict]:
    """Compile each variant ``{"kernel", "arch", "constexprs", "num_warps", "num_stages"}`` in a
    fresh process with TRITON_INTERPRET=0; returns one dict per variant (shared, regs, spill
    bytes, or "error"; with ``"loops": True`` in the variant also its tensor-core loops, see
    :func:`sass_loops`)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    code = ("import json,sys; from mla.aot import _worker; _worker()")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(variants), capture_output=True,
                          text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"AOT compile process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _worker():
    variants = json.loads(sys.stdin.read())
    out = []
    for v in variants:
        try:
            r = _compile_in_process(v["kernel"], v["arch"], v["constexprs"], v["num_warps"], v["num_stages"],
                                    tuple(v.get("asm", ())), v.get("types"), v.get("maxnreg", 0),
                                    v.get("loops", False), v.get("num_ctas", 1))
            r["fits"] = r["shared"] <= SMEM_LIMIT[v["arch"]] and r["usable"]
        except Exception as e:  # noqa: BLE001
            r = {"arch": v["arch"], "error": f"{type(e).__name__}: {str(e)[:500]}"}
        out.append({**{k: v[k] for k in ("kernel", "constexprs", "num_warps", "num_stages")}, **r})
    sys.stdout.write("\n" + json.dumps(out) + "\n")


def _flags(has_extra: bool, lengths: bool = True) -> dict:
    return {"HAS_SINK": True, "HAS_LEN": lengths, "HAS_EXTRA": has_extra, "HAS_ELEN": has_extra and lengths}


def tl_dot_variant(arch: int, block_h=64, block_n=64, num_warps=8, num_stages=1, dv_halves=1, has_extra=True,
                   lengths=True, dot="float16", maxnreg=0, asm: tuple = (), loops=False, v32: bool = False) -> dict:
    """The ``tl.dot`` kernel's variant for ``arch`` (sink and lengths on); ``maxnreg`` caps the
    registers ptxas may use; ``v32`` its form for DeepSeek-V3.2's cache (q 576 wide)."""
    constexprs = {**_flags(has_extra, lengths), "BLOCK_H": block_h, "BLOCK_N": block_n, "FP8_NATIVE": arch >= 89,
                  "DOT": dot, "DV_HALVES": dv_halves}
    if v32:                   # only where set: a MODEL1 variant is spelled as before the V3.2 form
        constexprs["V32"] = True
    return {"kernel": "tl_dot_decode_kernel", "arch": arch, "num_warps": num_warps, "num_stages": num_stages,
            "maxnreg": maxnreg, "loops": loops, "asm": list(asm), "constexprs": constexprs}


def gluon_variant(form: str = "heads as M", has_extra=True, lengths=True, align=16, asm: tuple = (),
                  loops=False, v32: bool = False) -> dict:
    """The Gluon sm_90 kernel's variant in a form of :data:`mla.configs.GLUON_FORMS` (sink and
    lengths on; cache rows copied ``align`` bytes at a time: 8 for page strides that are
    multiples of 8 only, as a contiguous cache's are at an odd page size). Warps, ring stages and
    register splits are the launch's (:func:`mla.kernels.gluon_sm90.launch_options`); ``v32`` its
    form for DeepSeek-V3.2's cache (heads as M only)."""
    from .kernels.gluon_sm90 import launch_options

    opts = launch_options(*GLUON_FORMS[form], v32=v32)
    return {"kernel": "gluon_decode_kernel", "arch": 90, "num_warps": opts.pop("num_warps"), "num_stages": 1,
            "maxnreg": 0, "loops": loops, "asm": list(asm),
            "constexprs": {**_flags(has_extra, lengths), "ALIGN": align, **opts}}


def portable_variant(arch: int, cfg, has_extra=True, lengths=True, align=16, asm: tuple = (),
                     loops=False) -> dict:
    """The portable Gluon kernel's variant for ``arch`` in a form
    (:class:`~mla.configs.PortableConfig`; sink and lengths on)."""
    from .kernels import gluon_portable

    kw = gluon_portable.launch_params(64, 1, block_h=cfg.block_h, block_n=cfg.block_n, fp8_native=arch >= 89,
                                      align=align, stages=cfg.stages)[1]
    return {"kernel": "gluon_portable_kernel", "arch": arch, "num_warps": kw.pop("num_warps"), "num_stages": 1,
            "maxnreg": 0, "loops": loops, "asm": list(asm), "constexprs": {**_flags(has_extra, lengths), **kw}}


def cluster_variant(has_extra=True, lengths=True, align=16, asm: tuple = (), loops=False) -> dict:
    """The Gluon sm_90 kernel's 128-head cluster form (:mod:`mla.kernels.gluon_sm90.cluster`; sink
    and lengths on), with the launch's warps, stages and CTAs a cluster."""
    from .kernels.gluon_sm90 import cluster

    kw = cluster.launch_params(128, 1, align=align)[1]
    return {"kernel": "gluon_cluster_kernel", "arch": 90, "num_warps": kw.pop("num_warps"),
            "num_ctas": kw.pop("num_ctas"), "num_stages": 1, "maxnreg": 0, "loops": loops, "asm": list(asm),
            "constexprs": {**_flags(has_extra, lengths), **kw}}


def config_variant(arch: int, cfg, asm: tuple = (), loops: bool = False, has_extra: bool = True,
                   v32: bool = False) -> dict:
    """The decode kernel's variant for ``arch`` under a :class:`~mla.configs.TlDotConfig` or a
    :class:`~mla.configs.GluonConfig` (``v32``: the kernel's form for DeepSeek-V3.2's cache)."""
    if cfg.kernel == "gluon":
        if v32 and cfg.form not in dispatch.GLUON_LAYOUTS[V32]:
            raise ValueError(f"v32: the Gluon kernel reads V3.2's cache in the forms {list(dispatch.GLUON_LAYOUTS[V32])} "
                             f"only (mla.dispatch.GLUON_LAYOUTS), not {cfg.form!r}")
        return gluon_variant(cfg.form, has_extra=has_extra, asm=asm, loops=loops, v32=v32)
    if cfg.kernel == "gluon_cluster":
        if v32 or arch != 90:
            raise ValueError("the cluster form is sm_90 code for the MODEL1 cache only")
        return cluster_variant(has_extra=has_extra, asm=asm, loops=loops)
    if cfg.kernel == "gluon_portable":
        if v32:
            raise ValueError("v32: the portable Gluon kernel reads the MODEL1 cache only (mla.dispatch.PORTABLE_LAYOUTS)")
        return portable_variant(arch, cfg, has_extra=has_extra, asm=asm, loops=loops)
    return tl_dot_variant(arch, block_h=cfg.block_h, block_n=cfg.block_n, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, dv_halves=cfg.dv_halves, has_extra=has_extra, asm=asm,
                          loops=loops, v32=v32)


def shipped_tl_dot_configs(arch: int) -> list:
    """Every ``tl.dot`` config that ``mla`` may launch on ``arch``: its generic table, plus the
    shipped tables of GPUs of that architecture (the H200 file for sm_90), each with the form
    :func:`~mla.dispatch.fill_small_grid` launches for a small grid."""
    tables = [configs.generic(arch)] + ([configs.table_for("NVIDIA H200", "3.6", 90)[1]] if arch == 90 else [])
    out = []
    for t in tables:
        for cfg in t.values():
            for c in (cfg, dispatch.fill_small_grid(cfg, 1, 1, cfg.block_h, 1, sms=1 << 20)):
                if c not in out:
                    out.append(c)
    return out


def shipped_variants(arch: int, v32: bool = False) -> list[dict]:
    """Every decode-kernel variant ``mla`` may launch on ``arch``: the ``tl.dot`` configs of
    :func:`shipped_tl_dot_configs` and, on sm_90, the Gluon kernel's forms; with ``v32``, those
    it may launch for DeepSeek-V3.2's cache: the same ``tl.dot`` configs and the Gluon forms of
    :data:`mla.dispatch.GLUON_LAYOUTS`, in their V3.2 form."""
    out = [config_variant(arch, c, v32=v32) for c in shipped_tl_dot_configs(arch)]
    if arch == 90:
        out += [gluon_variant(form, v32=v32) for form in dispatch.GLUON_LAYOUTS[V32 if v32 else MODEL1]]
    return out


def prefill_variant(arch: int, cfg, d_qk: int = 576, loops: bool = True) -> dict:
    """The sparse prefill kernel's variant for ``arch`` under a
    :class:`~mla.configs.PrefillConfig` (sink and lengths on, the config's operand type)."""
    return {"kernel": "sparse_prefill_kernel", "arch": arch, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "loops": loops, "constexprs": {"D_QK": d_qk, "HAS_SINK": True, "HAS_LEN": True, "BLOCK_H": cfg.block_h,
                                           "BLOCK_N": cfg.block_n, "DOT": cfg.dot}}


def shipped_prefill_variants(arch: int) -> list[dict]:
    """The prefill variants ``mla`` may launch on ``arch``: its config at d_qk 512 and 576."""
    return [prefill_variant(arch, configs.prefill_config(arch), d_qk) for d_qk in prefill.D_QKS]
