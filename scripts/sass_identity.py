"""Show that a refactor leaves the machine code alone: compile every kernel variant the launch
rule can pick, ahead of time (no GPU), and compare the SASS instruction text before and after.

    # once, in a checkout of the code before the change (its variants and hashes):
    PYTHONPATH=/path/to/old/checkout python scripts/sass_identity.py snapshot before.json
    # in this checkout, the same variants compiled from the current code, compared:
    python scripts/sass_identity.py compare before.json results/sass_identity.json

A variant is named by what it is (kernel, architecture, config, flags), not by the code's
parameter names, so the two sides may spell their constexprs differently: :func:`launch_spec`
translates a variant into either side's kernel arguments. Three generations of the code are
known: the one before the layered package (``mla/kernels/mma.py``), the layered package with a
``PARTIAL`` constexpr (its variants flag ``partial``), and the flat work list's kernels, whose
arguments :mod:`mla.aot` describes (its variants flag ``lengths``: HAS_LEN and HAS_ELEN). The SASS is normalised before it is
hashed: addresses, encodings and the kernel's name are dropped, labels kept (they are numbered
in program order). Registers, spills and shared memory are compared too. ``compare`` exits 1
if any variant differs, and also checks that every variant the current code ships
(:func:`current_variants`) was among those compared.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"        # before Triton is imported: compile, not interpret

ARCHS = (80, 89, 90, 100, 120)
#: the Gluon kernel's forms: (heads per program, 64-token ring tiles per consumer tile, two consumers)
GLUON_FORMS = {"heads as M": (64, 1, False), "tokens as M 16x64": (16, 1, False),
               "tokens as M 8x128": (8, 2, False), "tokens as M two consumers": (8, 1, True)}
_FLAG_SETS = ((True, True), (True, False), (False, True))     # (has_extra, partial or lengths)

_DECODE_TYPES = {
    "q_ptr": "*bf16", "out_ptr": "*bf16", "lse_ptr": "*fp32", "sink_ptr": "*fp32", "po_ptr": "*fp16",
    "plse_ptr": "*fp32", "kc_ptr": "*u8", "kc_stride": "i32", "kc_P": "i32", "kc_n": "i32", "idx_ptr": "*i32",
    "topk": "i32", "len_ptr": "*i32", "ec_ptr": "*u8", "ec_stride": "i32", "ec_P": "i32", "ec_n": "i32",
    "eidx_ptr": "*i32", "etopk": "i32", "elen_ptr": "*i32", "s_q": "i32", "h_q": "i32",
    "sm_scale_log2": "fp32", "num_splits": "i32",
}
_ALIGNED = {"q_ptr", "out_ptr", "lse_ptr", "sink_ptr", "po_ptr", "plse_ptr", "kc_ptr", "idx_ptr", "len_ptr",
            "ec_ptr", "eidx_ptr", "elen_ptr", "kc_stride", "ec_stride"}


def _new_layout() -> bool:
    """Whether the code under test is the layered package (``mla/dispatch.py``) or the one before
    it. (A file test: an editable install's finder would find a module of another checkout.)"""
    import mla

    return os.path.exists(os.path.join(os.path.dirname(mla.__file__), "dispatch.py"))


def key(v: dict) -> str:
    return " ".join(f"{k}={v[k]}" for k in sorted(v))


# ------------------------------------------------------------------------------------------
# The variants
# ------------------------------------------------------------------------------------------

def _tl_variants(configs_by_arch, flag: str = "partial") -> list[dict]:
    out = []
    for arch, cfgs in configs_by_arch.items():
        for c in cfgs:
            for has_extra, on in _FLAG_SETS:
                out.append({"kernel": "tl_dot", "arch": arch, **c, "has_extra": has_extra, flag: on})
    return out


def _fixed_variants(flag: str = "partial") -> list[dict]:
    """The Gluon forms, the combine and the SIMT kernel: the same on both sides."""
    out = []
    for form in GLUON_FORMS:
        for align, on, has_extra in ((16, True, True), (16, False, True), (8, True, True), (8, False, True),
                                     (16, True, False)):
            out.append({"kernel": "gluon", "arch": 90, "form": form, "align": align, flag: on,
                        "has_extra": has_extra})
    for arch in ARCHS:
        for sink in (True, False):
            out.append({"kernel": "combine", "arch": arch, "has_sink": sink})
        for has_extra in (True, False):
            out.append({"kernel": "simt", "arch": arch, "has_extra": has_extra})
    return out


def _tl_fields(cfg) -> dict:
    return {"block_h": cfg.block_h, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "dv_halves": cfg.dv_halves}


def old_variants() -> list[dict]:
    """Every variant the code before the layered package could launch (its own enumeration:
    the generic and shipped tables per architecture, each with its small-grid form)."""
    from mla import configs
    from mla.kernels.mma import fill_small_grid

    by_arch = {}
    for arch in ARCHS:
        tables = [configs.generic(arch)] + ([configs.table_for("NVIDIA H200", "3.6", 90)[1]] if arch == 90 else [])
        seen = []
        for t in tables:
            for cfg in t.values():
                for c in (cfg, fill_small_grid(cfg, 1, 1, cfg.block_h, 1, sms=1 << 20)):
                    f = _tl_fields(c)
                    if f not in seen:
                        seen.append(f)
        by_arch[arch] = seen
    return _tl_variants(by_arch) + _fixed_variants()


def _flat_work_list() -> bool:
    """Whether the code under test has the flat work list's kernels (no ``PARTIAL`` constexpr)."""
    from mla.kernels.tl_dot import tl_dot_decode_kernel

    return "PARTIAL" not in tl_dot_decode_kernel.arg_names


def current_variants() -> list[dict]:
    """Every variant the code under test can launch, by its own enumeration."""
    if not _new_layout():
        return old_variants()
    from mla import aot

    by_arch = {arch: [] for arch in ARCHS}
    for arch in ARCHS:
        for cfg in aot.shipped_tl_dot_configs(arch):
            f = _tl_fields(cfg)
            if f not in by_arch[arch]:
                by_arch[arch].append(f)
    flag = "lengths" if _flat_work_list() else "partial"
    return _tl_variants(by_arch, flag) + _fixed_variants(flag)


# ------------------------------------------------------------------------------------------
# A variant as kernel arguments, on either side
# ------------------------------------------------------------------------------------------

def _flat_spec(v: dict):
    """:func:`launch_spec` for the flat work list's kernels, from :mod:`mla.aot`'s own variants (so
    that the two cannot drift apart)."""
    from mla import aot
    from mla.kernels import combine

    k, arch = v["kernel"], v["arch"]
    if k == "tl_dot":
        a = aot.tl_dot_variant(arch, block_h=v["block_h"], block_n=v["block_n"], num_warps=v["num_warps"],
                               num_stages=v["num_stages"], dv_halves=v["dv_halves"], has_extra=v["has_extra"],
                               lengths=v["lengths"])
    elif k == "gluon":
        heads, units, duo = GLUON_FORMS[v["form"]]
        form = {f: h for f, h in aot.GLUON_FORMS.items() if h == (heads, units * 64, duo)}
        (name,) = form
        a = aot.gluon_variant(name, has_extra=v["has_extra"], lengths=v["lengths"], align=v["align"])
    elif k == "combine":
        _grid, kw = combine.launch_params(2, 2, 1, v["has_sink"], True)
        ce = {n: kw[n] for n in ("HAS_SINK", "FLAT", "BY_QUERY")}
        types = {"po_ptr": "*fp16", "plse_ptr": "*fp32", "rec_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
                 "sink_ptr": "*fp32", "sink_stride": "i32", "s_q": "i32", "h_q": "i32", "num_splits": "i32"}
        return combine.combine_kernel, False, ce, types, kw["num_warps"], kw["num_stages"]
    elif k == "simt":
        from mla.kernels import simt

        ce = {"HAS_SINK": True, "HAS_LEN": True, "HAS_EXTRA": v["has_extra"], "HAS_ELEN": v["has_extra"],
              "BLOCK_N": simt.BLOCK_N, "FP8_NATIVE": arch >= 89}
        return simt.simt_decode_kernel, False, ce, dict(aot._DECODE_TYPES), simt.NUM_WARPS, 1
    else:
        raise ValueError(f"unknown kernel {k!r}")
    kern, gluon = aot._kernel(a["kernel"])
    ce = dict(a["constexprs"])
    if isinstance(ce.get("DOT"), str):
        import triton.language as tl

        ce["DOT"] = getattr(tl, ce["DOT"])
    return kern, gluon, ce, dict(aot._DECODE_TYPES), a["num_warps"], a["num_stages"]


def launch_spec(v: dict):
    """(kernel, is Gluon, constexprs, signature types, num_warps, num_stages) of a variant."""
    import triton.language as tl

    new = _new_layout()
    if new and _flat_work_list():
        return _flat_spec(v)
    k = v["kernel"]
    arch = v["arch"]
    flags = {"HAS_SINK": True, "HAS_LEN": True}
    if k in ("tl_dot", "gluon", "simt"):
        flags.update(HAS_EXTRA=v["has_extra"], HAS_ELEN=v["has_extra"])
    if k == "tl_dot":
        if new:
            from mla.kernels.tl_dot import tl_dot_decode_kernel as kern
            extra = {}
        else:
            from mla.kernels.mma import mma_decode_kernel as kern
            extra = {"TOKENS_AS_M": False, "PREFETCH": False, "P_SPLIT": False, "ABLATE": 0}
        ce = {**flags, "PARTIAL": v["partial"], "BLOCK_H": v["block_h"], "BLOCK_N": v["block_n"],
              "FP8_NATIVE": arch >= 89, "DOT": tl.float16, "DV_HALVES": v["dv_halves"], **extra}
        return kern, False, ce, dict(_DECODE_TYPES), v["num_warps"], v["num_stages"]
    if k == "gluon":
        heads, units, duo = GLUON_FORMS[v["form"]]
        if new:
            from mla.kernels.gluon_sm90 import gluon_decode_kernel as kern
            from mla.kernels.gluon_sm90 import launch_options

            opts = launch_options(heads, units * 64, duo)
            warps = opts.pop("num_warps")
            ce = {**flags, "PARTIAL": v["partial"], "ALIGN": v["align"], **opts}
        else:
            from mla.kernels.wgmma import launch_options
            from mla.kernels.wgmma import wgmma_decode_kernel as kern

            opts = launch_options(duo)
            warps = opts.pop("num_warps")
            ce = {**flags, "PARTIAL": v["partial"], "BLOCK_N": 64, "ALIGN": v["align"], "ABLATE": 0, "BH": heads,
                  "U": units, **opts}
        types = dict(_DECODE_TYPES)
        return kern, True, ce, types, warps, 1
    if k == "combine":
        if new:
            from mla.kernels.combine import combine_kernel as kern
        else:
            from mla.kernels.mma import combine_kernel as kern
        types = {"po_ptr": "*fp16", "plse_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
                 "sink_ptr": "*fp32", "s_q": "i32", "h_q": "i32", "num_splits": "i32"}
        return kern, False, {"HAS_SINK": v["has_sink"], "BLOCK_HC": 1}, types, 4, 1
    if k == "simt":
        from mla.kernels.simt import simt_decode_kernel as kern

        types = {n: t for n, t in _DECODE_TYPES.items() if n not in ("po_ptr", "plse_ptr", "num_splits")}
        ce = {**flags, "BLOCK_N": 16, "FP8_NATIVE": arch >= 89}
        return kern, False, ce, types, 4, 1
    raise ValueError(f"unknown kernel {k!r}")


# ------------------------------------------------------------------------------------------
# Compiling and normalising
# ------------------------------------------------------------------------------------------

def normalise_sass(sass: str) -> str:
    """The instruction text of an nvdisasm listing: no addresses, encodings or kernel name."""
    lines = []
    for line in sass.splitlines():
        line = re.sub(r"/\*[0-9a-fA-Fx]+\*/", "", line)          # addresses and encodings
        line = line.strip()
        if not line or line.startswith("//"):
            continue
        if line.startswith((".section", ".global", ".type", ".size", ".text.", ".headerflags", ".elftype",
                            ".nv.", ".align", ".sectionflags", ".sectioninfo", ".other", "//--")):
            continue
        lines.append(re.sub(r"\s+", " ", line))
    return "\n".join(lines)


def compile_variant(v: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    kern, gluon, ce, types, warps, stages = launch_spec(v)
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: F811
    ce = dict(ce)
    for i, name in enumerate(kern.arg_names):           # constexprs left out take their defaults
        if name not in ce and name not in types:
            ce[name] = kern.params[i].default
    aligned = _ALIGNED - ({"kc_stride", "ec_stride"} if ce.get("ALIGN") == 8 else set())
    sig, attrs = {}, {}
    for i, name in enumerate(kern.arg_names):
        if name in ce:
            sig[name] = "constexpr"
        else:
            sig[name] = types[name]
            if name in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    ck = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=ce, attrs=attrs),
                        target=GPUTarget("cuda", v["arch"], 32), options={"num_warps": warps, "num_stages": stages})
    tool = get_ptxas(v["arch"])
    ptxas = tool.path if hasattr(tool, "path") else tool[0]
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(ck.asm["cubin"])
        dis = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", cubin], capture_output=True,
                             text=True, check=True).stdout
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(ck.asm["ptx"])
        sm = re.search(r"^\s*\.target\s+(sm_\w+)", ck.asm["ptx"], re.M).group(1)
        rep = subprocess.run([ptxas, "-v", f"-arch={sm}", ptx, "-o", os.path.join(d, "x.cubin")],
                             capture_output=True, text=True)
    txt = rep.stdout + rep.stderr
    name = ck.metadata.name
    sass = normalise_sass(dis.replace(name, "KERNEL"))
    regs = re.findall(r"Used (\d+) registers", txt)
    spill = re.findall(r"(\d+) bytes spill stores", txt)
    return {"sass_sha256": hashlib.sha256(sass.encode()).hexdigest(), "instructions": sass.count(";"),
            "regs": int(regs[-1]) if regs else -1, "spill_bytes": int(spill[-1]) if spill else 0,
            "shared": int(ck.metadata.shared)}


def _one(v):
    try:
        return key(v), {**compile_variant(v), "variant": v}
    except Exception as e:  # noqa: BLE001
        return key(v), {"variant": v, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def compile_all(variants: list[dict], jobs: int) -> dict:
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="sass_identity_"))
    out = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as ex:
        for i, (k, r) in enumerate(ex.map(_one, variants), 1):
            out[k] = r
            print(f"[{i}/{len(variants)}] {k}: {r.get('error') or r['sass_sha256'][:12]}", file=sys.stderr)
    return out


def _provenance() -> dict:
    import triton

    import mla
    root = os.path.dirname(os.path.dirname(os.path.abspath(mla.__file__)))
    commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return {"commit": commit + ("+dirty" if dirty else ""), "triton": triton.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot", help="compile the variants of the code on PYTHONPATH, write their hashes")
    s.add_argument("out")
    c = sub.add_parser("compare", help="compile a snapshot's variants from this code and compare")
    c.add_argument("before")
    c.add_argument("out")
    for p in (s, c):
        p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    if a.cmd == "snapshot":
        variants = current_variants()
        res = compile_all(variants, a.jobs)
        with open(a.out, "w") as f:
            json.dump({"provenance": _provenance(), "variants": res}, f, indent=1)
        bad = [k for k, r in res.items() if "error" in r]
        print(f"{len(res)} variants, {len(bad)} errors")
        return 1 if bad else 0
    before = json.load(open(a.before))
    variants = [r["variant"] for r in before["variants"].values()]
    after = compile_all(variants, a.jobs)
    rows, fields = [], ("sass_sha256", "regs", "spill_bytes", "shared")
    for k, b in before["variants"].items():
        n = after[k]
        same = "error" not in n and "error" not in b and all(b[f] == n[f] for f in fields)
        rows.append({"variant": b["variant"], "same": same,
                     "before": {f: b.get(f) for f in fields + ("instructions",)} | ({"error": b["error"]} if "error" in b else {}),
                     "after": {f: n.get(f) for f in fields + ("instructions",)} | ({"error": n["error"]} if "error" in n else {})})
    compared = {key(r["variant"]) for r in rows}
    unseen = [key(v) for v in current_variants() if key(v) not in compared]
    record = {"before": before["provenance"], "after": _provenance(), "identical": sum(r["same"] for r in rows),
              "variants": len(rows), "shipped_but_not_compared": unseen, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)
    diff = [key(r["variant"]) for r in rows if not r["same"]]
    print(f"{record['identical']} of {len(rows)} variants compile to the same SASS; "
          f"{len(unseen)} shipped variants not compared")
    for d in diff:
        print("  differs:", d)
    for u in unseen:
        print("  not compared:", u)
    return 1 if diff or unseen else 0


if __name__ == "__main__":
    sys.exit(main())
