"""The kernels' configs: one small type per kernel, and the shipped tables as JSON keyed by GPU
name and Triton version (the way vLLM and SGLang ship tuned configs). Serving calls read them;
nothing here autotunes, and nothing here imports a kernel.

A file ``<slug>.json`` holds ``{"gpu": "NVIDIA H200", "triton": "3.6", "measured": "...",
"tl_dot": {"16": {...}, "32": {...}, "64": {...}, "128": {...}}, "gluon": true}``: one
:class:`TlDotConfig` of the portable ``tl.dot`` kernel per bucket of h_q (the smallest bucket >=
h_q applies), and whether the launch rule (:mod:`mla.dispatch`) may run the Gluon sm_90 kernel on
that GPU. Set ``MLA_CONFIG_FILE`` to use another file.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib

import torch
import triton

log = logging.getLogger("mla")
_DIR = pathlib.Path(__file__).parent
BUCKETS = (16, 32, 64, 128)
#: the smallest M of a tensor-core dot: a head block is never smaller (heads are padded)
MIN_BLOCK_H = 16


def head_block(block_h: int, h_q: int) -> int:
    """A config's head block for h_q: at most h_q rounded up to a power of two, at least 16."""
    p2 = 1 << max(0, int(h_q) - 1).bit_length()
    return max(MIN_BLOCK_H, min(block_h, p2))


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """What the ``tl.dot`` kernels' launches share: a program's tile and its warps and stages."""

    block_h: int = 64       #: heads per program (the M of the dots)
    block_n: int = 64       #: tokens per tile (the N of S = Q.K^T)
    num_warps: int = 8
    num_stages: int = 1

    def for_heads(self, h_q: int):
        """The head block for h_q: at most h_q rounded up to a power of two, at least 16."""
        p2 = 1 << max(0, int(h_q) - 1).bit_length()
        return dataclasses.replace(self, block_h=max(MIN_BLOCK_H, min(self.block_h, p2)))


@dataclasses.dataclass(frozen=True)
class TlDotConfig(TileConfig):
    """Launch parameters of the portable ``tl.dot`` decode kernel (:mod:`mla.kernels.tl_dot`)."""

    #: 2: two programs per head block, each owning 256 of the 512 output columns (the form the
    #: launch rule picks for a grid too small to fill the GPU)
    dv_halves: int = 1

    def __post_init__(self):
        if self.dv_halves not in (1, 2):
            raise ValueError(f"config: dv_halves must be 1 or 2, got {self.dv_halves}")

    @property
    def kernel(self) -> str:
        return "tl_dot"

    @property
    def label(self) -> str:
        return "tl.dot" + (", split P.V" if self.dv_halves == 2 else "")

    def for_heads(self, h_q: int) -> "TlDotConfig":
        return dataclasses.replace(self, block_h=head_block(self.block_h, h_q))


#: The Gluon sm_90 kernel's forms: (heads per program, tokens per consumer tile, two consumers).
#: Heads as M: 64 heads are one warpgroup's M. Tokens as M (few heads, small grids): the token
#: tile is the M of the dots and the heads are N, 16, or 8 with 128-token tiles, or 8 with two
#: consumer warpgroups on alternate 64-token tiles.
GLUON_FORMS = {
    "heads as M": (64, 64, False),
    "tokens as M, 16 x 64": (16, 64, False),
    "tokens as M, 8 x 128": (8, 128, False),
    "tokens as M, two consumers": (8, 64, True),
}


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    """The Gluon sm_90 kernel's form (:mod:`mla.kernels.gluon_sm90`): everything else about its
    launch (warps, ring stages, register split) follows from the form."""

    form: str = "heads as M"

    def __post_init__(self):
        if self.form not in GLUON_FORMS:
            raise ValueError(f"config: form must be one of {list(GLUON_FORMS)}, got {self.form!r}")

    @property
    def kernel(self) -> str:
        return "gluon"

    @property
    def block_h(self) -> int:
        return GLUON_FORMS[self.form][0]

    @property
    def block_n(self) -> int:
        return GLUON_FORMS[self.form][1]

    @property
    def two_consumers(self) -> bool:
        return GLUON_FORMS[self.form][2]

    @property
    def label(self) -> str:
        return f"Gluon, {self.form}"

    def for_heads(self, h_q: int) -> "GluonConfig":
        return self


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """The Gluon sm_90 kernel's 128-head form as a cluster of 2 CTAs
    (:mod:`mla.kernels.gluon_sm90.cluster`): each CTA decodes half of every token tile for both.
    Its launch follows from the form; it needs a Triton whose Gluon has cross-CTA stores (3.9)."""

    @property
    def kernel(self) -> str:
        return "gluon_cluster"

    @property
    def block_h(self) -> int:
        return 128

    @property
    def block_n(self) -> int:
        return 64

    @property
    def ctas(self) -> int:
        """CTAs a program (SMs it occupies)."""
        return 2

    @property
    def label(self) -> str:
        return "Gluon, heads as M, 2-CTA cluster"

    def for_heads(self, h_q: int) -> "ClusterConfig":
        return self


#: Largest shared memory a block may use, bytes (the opt-in maximum), per architecture.
SMEM_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}


def smem_limit(arch: int) -> int:
    """:data:`SMEM_LIMIT` for ``arch``; sm_86 (A10, RTX 30xx) has sm_89's 99 KB, another
    architecture the nearest one's below it."""
    if arch == 86:
        return SMEM_LIMIT[89]
    known = [a for a in sorted(SMEM_LIMIT) if a <= arch]
    return SMEM_LIMIT[known[-1]] if known else SMEM_LIMIT[80]


@dataclasses.dataclass(frozen=True)
class PortableConfig:
    """The portable Gluon kernel (:mod:`mla.kernels.gluon_portable`): heads per program (the M of
    the dots), tokens per tile and ring stages (``stages - 1`` tiles' copies in flight)."""

    block_h: int = 64
    block_n: int = 64
    stages: int = 2

    def __post_init__(self):
        if self.block_h not in (16, 32, 64) or self.block_n not in (32, 64) or self.stages < 2:
            raise ValueError(f"config: block_h 16, 32 or 64, block_n 32 or 64, stages >= 2; got {self}")

    @property
    def kernel(self) -> str:
        return "gluon_portable"

    @property
    def label(self) -> str:
        return f"Gluon portable, {self.block_h} heads x {self.block_n} tokens, {self.stages} stages"

    def for_heads(self, h_q: int) -> "PortableConfig":
        return dataclasses.replace(self, block_h=head_block(self.block_h, h_q))


def portable_shared_bytes(cfg: PortableConfig) -> int:
    """Shared memory of a portable-kernel program: Q and the tile buffer in fp16, the ring's stages
    (per token 512 FP8 bytes with group 7 unused, 128 of rope, 8 of scales) and the scratch of P's
    move into the A operand's layout."""
    return 2 * 512 * (cfg.block_h + cfg.block_n) + cfg.stages * cfg.block_n * (512 + 128 + 8) \
        + 2 * cfg.block_h * cfg.block_n


#: the portable kernel's forms, largest head block first: the launch takes the first that fits.
#: 64 heads x 32 tokens, 3 stages, is the 64-head form of sm_80's 163 KB
PORTABLE_FORMS = (PortableConfig(64, 64, 2), PortableConfig(64, 32, 3), PortableConfig(32, 64, 2),
                  PortableConfig(32, 32, 3), PortableConfig(16, 64, 2), PortableConfig(16, 32, 2))


def portable_generic(arch: int) -> dict:
    """The portable kernel's table for sm_``arch``: per head bucket the first form of
    :data:`PORTABLE_FORMS` (for that bucket's heads) that fits the architecture's shared memory
    (:func:`smem_limit`). Every form's token-tile loop compiles without a spill on every
    architecture, its 128 accumulator registers a thread at 64 heads included (tests/test_aot.py)."""
    limit = smem_limit(arch)
    return {h: next(c.for_heads(h) for c in PORTABLE_FORMS if portable_shared_bytes(c.for_heads(h)) <= limit)
            for h in (16, 32, 64, 128)}


#: Registers per thread that a ``tl.dot`` program's share of its output accumulator may take on
#: the architectures whose tensor-core instruction (``mma.sync``) takes its A operand from
#: registers: Q and P sit in registers beside the accumulator, the dequantized tile and S, in the
#: 255 a thread has. sm_80 decodes FP8 in software, which costs registers of its own. The limits
#: are those at which every shipped config's token-tile loop compiles without a spill
#: (tests/test_aot.py); sm_90's wgmma reads both operands from shared memory and is not limited so.
ACCUMULATOR_REGS = {80: 16, 86: 16, 89: 32, 100: 32, 120: 32}
#: warps of a generic program: two warpgroups, as the H200's table has
GENERIC_WARPS = 8


def accumulator_regs(cfg: "TlDotConfig") -> int:
    """Registers per thread of a program's output accumulator: ``block_h`` x 512 / ``dv_halves``
    fp32 values over its ``32 * num_warps`` threads."""
    return cfg.block_h * 512 // cfg.dv_halves // (32 * cfg.num_warps)


def generic(arch: int = 90) -> dict:
    """Untuned ``tl.dot`` defaults for an architecture (``arch`` = 10*major + minor), derived from
    its limits rather than copied from a tuned table. sm_90: a head block of 64 (wgmma keeps its
    operands in shared memory; 128 accumulator registers a thread at 8 warps). Elsewhere, per
    head bucket, the largest head block (and, for it, the whole 512 columns before half of them)
    whose accumulator share fits :data:`ACCUMULATOR_REGS`: BLOCK_H 32 with the columns split over
    two programs on sm_89/100/120, 16 on sm_80. One stage, tiles of 64 tokens: every config fits
    the 99 KB parts' shared memory (tests/test_aot.py compiles each)."""
    if arch == 90:
        return {h: TlDotConfig(block_h=min(h, 64), num_warps=GENERIC_WARPS) for h in (16, 32, 64, 128)}
    limit = ACCUMULATOR_REGS.get(arch, ACCUMULATOR_REGS[80] if arch < 89 else ACCUMULATOR_REGS[89])
    table = {}
    for h in (16, 32, 64, 128):
        fits = [TlDotConfig(block_h=bh, num_warps=GENERIC_WARPS, dv_halves=dv)
                for bh in (64, 32, 16) if bh <= h for dv in (1, 2)]
        table[h] = next(c for c in fits if accumulator_regs(c) <= limit)
    return table


def _files():
    env = os.environ.get("MLA_CONFIG_FILE")
    return [pathlib.Path(env)] if env else sorted(_DIR.glob("*.json"))


def _minor(triton_version: str) -> str:
    return ".".join(triton_version.split(".")[:2])


def _match(gpu_name: str, tv: str):
    """(file, its data) of the config file for this GPU, preferring the one tuned with Triton
    minor version ``tv``; None if no file names the GPU."""
    match = None
    for f in _files():
        data = json.loads(f.read_text())
        if data.get("gpu") != gpu_name:
            continue
        if match is None or data.get("triton") == tv:
            match = (f, data)
    return match


@functools.lru_cache(maxsize=None)
def table_for(gpu_name: str, triton_version: str, arch: int = 90):
    """(source, {bucket: TlDotConfig}) for a GPU name and Triton version: the shipped file's, or
    the generic table if no file names the GPU (a file for another Triton minor version still
    applies, and the log says so)."""
    tv = _minor(triton_version)
    match = _match(gpu_name, tv)
    if match is None:
        log.info("mla: no shipped config for %s; generic tl.dot defaults for sm_%d", gpu_name, arch)
        return "generic", generic(arch)
    f, data = match
    table = {int(k): TlDotConfig(**v) for k, v in data["tl_dot"].items()}
    note = "" if data.get("triton") == tv else f" (tuned with Triton {data.get('triton')}, running {tv})"
    log.info("mla: configs from %s for %s%s", f.name, gpu_name, note)
    return f.name, table


@functools.lru_cache(maxsize=None)
def gluon_for(gpu_name: str, triton_version: str, arch: int = 90) -> bool:
    """Whether the launch rule may run the Gluon sm_90 kernel on this GPU: any sm_90 GPU with no
    shipped file, or one whose file says ``"gluon": true``."""
    if arch != 90:
        return False
    match = _match(gpu_name, _minor(triton_version))
    return True if match is None else bool(match[1].get("gluon", False))


def bucket_config(table: dict, h_q: int) -> TlDotConfig:
    """The table's config for h_q (the smallest bucket >= h_q), sized for h_q's head block."""
    for b in BUCKETS:
        if h_q <= b and b in table:
            return table[b].for_heads(h_q)
    return table[max(table)].for_heads(h_q)


def device_facts(device):
    """(name, Triton version, arch) of a CUDA device: the keys of its tables."""

    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), triton.__version__, 10 * major + minor


def lookup(h_q: int, device: torch.device) -> TlDotConfig:
    """The shipped ``tl.dot`` config for h_q on this CUDA device."""
    return bucket_config(table_for(*device_facts(device))[1], h_q)


def gluon_enabled(device: torch.device) -> bool:
    """Whether the Gluon sm_90 kernel may run on this CUDA device (by its table)."""
    return gluon_for(*device_facts(device))


def source(device=None) -> str:
    """Which table serves this device: a shipped file's name, or "generic"."""
    return table_for(*device_facts(device))[0]


def write(path, gpu_name: str, triton_version: str, table: dict, measured: str = "", gluon: bool = False) -> None:
    """Write a config file in the shipped format (``table``: bucket -> TlDotConfig)."""
    data = {"gpu": gpu_name, "triton": _minor(triton_version), "measured": measured,
            "tl_dot": {str(k): dataclasses.asdict(c) for k, c in sorted(table.items())}, "gluon": bool(gluon)}
    pathlib.Path(path).write_text(json.dumps(data, indent=1) + "\n")


#: The config under Triton's CPU interpreter: small tiles, one config (it cannot autotune).
INTERPRETER = TlDotConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)


@dataclasses.dataclass(frozen=True)
class PrefillConfig(TileConfig):
    """Launch parameters of the sparse prefill kernel (:mod:`mla.kernels.prefill`)."""

    #: the dots' operand type on a GPU: "float16" (P to 2**-11; q and kv must stay inside fp16's
    #: range, |x| < 65504) or "bfloat16" (P to 2**-8, as FlashMLA's kernel rounds it; no range
    #: limit); the module docstring of :mod:`mla.kernels.prefill` weighs the two
    dot: str = "float16"

    def __post_init__(self):
        if self.dot not in ("float16", "bfloat16"):
            raise ValueError(f"config: dot must be 'float16' or 'bfloat16', got {self.dot!r}")


#: The prefill's config per architecture: the largest head block, then the largest token tile,
#: whose kernel, at d_qk 512 and 576 with fp16 operands, compiles inside the architecture's shared
#: memory with its token-tile loop on the tensor cores and in registers (tests/test_aot.py
#: compiles each). sm_90: 64 heads x 64 tokens, FlashMLA's sm_90 tile, two stages (192 and 216
#: KB); its loop stores and reloads a few spilled values a tile (4 at d_qk 512, 5 at 576, of some
#: 1300-1500 instructions: a [64, 512] fp32 accumulator is 128 registers a thread, and the
#: gathered tile passes through registers to be converted). With one stage it spills ten times
#: more; 64 x 32 tiles spill about as much per token and take a third more instructions per
#: token (the accumulator's rescale is per tile). sm_100: 32 heads (at 64 Triton lowers the
#: kernel to a lone trap, as it does where the accumulators exceed tensor memory: two [64, 256]
#: halves and S would take 576 of its 512 columns). sm_80: 64 heads x 32 tokens, two stages (64 x
#: 64 does not fit its 163 KB; one stage spills at 576). sm_89, sm_120 (and sm_86, the other 99 KB
#: parts): 32 x 32, 64-68 KB.
PREFILL = {90: PrefillConfig(64, 64, 8, 2), 100: PrefillConfig(32, 64), 80: PrefillConfig(64, 32, 8, 2),
           89: PrefillConfig(32, 32), 120: PrefillConfig(32, 32)}
#: The prefill's config under the interpreter: the largest tiles, which are the fewest numpy steps
#: (128 heads in one program run in about half the time of two programs of 64); its operands are
#: float32 whatever ``dot`` says.
PREFILL_INTERPRETER = PrefillConfig(128, 128, num_warps=4)


def prefill_config(arch: int) -> PrefillConfig:
    """The prefill's config for an architecture (``arch`` = 10*major + minor): its own entry of
    :data:`PREFILL`, else (an architecture no entry names) the 99 KB parts' one, the smallest."""
    return PREFILL.get(arch, PREFILL[89])
