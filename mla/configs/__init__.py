"""Shipped launch configs of the MMA kernel, as JSON keyed by GPU name and Triton version
(the way vLLM and SGLang ship tuned configs). Serving calls read them; they never autotune.

A file ``<slug>.json`` holds ``{"gpu": "NVIDIA H200", "triton": "3.6", "measured": "...",
"configs": {"16": {...}, "32": {...}, "64": {...}, "128": {...}}, "hopper": {...}}``: one MMAConfig
of the portable ``tl.dot`` kernel per bucket of h_q (the smallest bucket >= h_q applies), and,
for a Hopper GPU, the config of the Gluon sm_90 kernel (:mod:`mla.kernels.wgmma`) that
:func:`mla.kernels.mma.launch_config` launches instead when the grid fills the GPU. Set
``MLA_CONFIG_FILE`` to use another file.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import pathlib

import torch

log = logging.getLogger("mla")
_DIR = pathlib.Path(__file__).parent
BUCKETS = (16, 32, 64, 128)


def generic(arch: int = 90) -> dict:
    """Untuned defaults for an architecture (``arch`` = 10*major + minor). One stage, so that
    they fit the 99 KB parts too (tests/test_aot.py checks every architecture)."""
    from ..kernels.mma import MMAConfig

    bn = 64
    # sm_100 (Blackwell): with Triton 3.9 a BLOCK_H 64 program's two [64, 256] fp32 accumulators
    # plus S do not fit tensor memory and the kernel compiles to a lone `trap` (mla.aot reports
    # it as not usable); BLOCK_H 32 compiles to a real kernel. The 99 KB parts (sm_86/89/120):
    # Triton 3.6 gives BLOCK_H 64 131072 bytes of shared memory there, BLOCK_H 32 98304.
    bh = 64 if arch in (80, 90) else 32
    return {16: MMAConfig(block_h=16, block_n=64, num_warps=8), 32: MMAConfig(block_h=32, block_n=bn, num_warps=8),
            64: MMAConfig(block_h=bh, block_n=bn), 128: MMAConfig(block_h=bh, block_n=bn)}


def generic_hopper(arch: int = 90):
    """The Gluon kernel's config on a Hopper GPU with no shipped file (sm_90 only), else None."""
    from ..kernels.mma import MMAConfig

    return MMAConfig(kernel="wgmma") if arch == 90 else None


def _files():
    env = os.environ.get("MLA_CONFIG_FILE")
    return [pathlib.Path(env)] if env else sorted(_DIR.glob("*.json"))


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


def _minor(triton_version: str) -> str:
    return ".".join(triton_version.split(".")[:2])


@functools.lru_cache(maxsize=None)
def table_for(gpu_name: str, triton_version: str, arch: int = 90):
    """(source, {bucket: MMAConfig}) for a GPU name and Triton version; the generic table if no
    shipped file matches the GPU (a file for another Triton minor version still applies, logged)."""
    from ..kernels.mma import MMAConfig, mma_decode_kernel
    from ..tuning import kernel_name

    tv = _minor(triton_version)
    log.info("mla: %s on %s (sm_%d, Triton %s) launches with a config table, never autotuning",
             kernel_name(mma_decode_kernel), gpu_name, arch, tv)
    match = _match(gpu_name, tv)
    if match is None:
        log.info("mla: no shipped MMA config for %s; using generic defaults for sm_%d", gpu_name, arch)
        return "generic", generic(arch)
    f, data = match
    table = {int(k): MMAConfig(**v) for k, v in data["configs"].items()}
    note = "" if data.get("triton") == tv else f" (tuned with Triton {data.get('triton')}, running {tv})"
    log.info("mla: MMA configs from %s for %s%s", f.name, gpu_name, note)
    return f.name, table


@functools.lru_cache(maxsize=None)
def hopper_for(gpu_name: str, triton_version: str, arch: int = 90):
    """The Gluon sm_90 kernel's config for this GPU (the ``hopper`` entry of the file
    :func:`table_for` picks, or the generic one on any sm_90 GPU with no file), or None: not
    sm_90, or a file that names none."""
    from ..kernels.mma import MMAConfig

    if arch != 90:
        return None
    match = _match(gpu_name, _minor(triton_version))
    if match is None:
        return generic_hopper(arch)
    entry = match[1].get("hopper")
    return MMAConfig(**entry) if entry else None


def lookup(h_q: int, device: torch.device):
    """The MMAConfig for h_q on this device."""
    import triton

    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    _, table = table_for(name, triton.__version__, 10 * major + minor)
    for b in BUCKETS:
        if h_q <= b and b in table:
            return table[b]
    return table[max(table)]


def hopper(device: torch.device):
    """The Gluon sm_90 kernel's config on this device, or None."""
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return hopper_for(torch.cuda.get_device_name(device), triton.__version__, 10 * major + minor)


def source(device=None) -> str:
    """Which table serves this device: a shipped file's name, or "generic"."""
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return table_for(torch.cuda.get_device_name(device), triton.__version__, 10 * major + minor)[0]


def write(path, gpu_name: str, triton_version: str, table: dict, measured: str = "", hopper_cfg=None) -> None:
    """Write a config file in the shipped format (``table``: bucket -> MMAConfig; ``hopper_cfg``:
    the Gluon sm_90 kernel's MMAConfig, if any)."""
    import dataclasses

    def fields(c):
        return {f: v for f, v in dataclasses.asdict(c).items() if f != "ablate"}

    data = {"gpu": gpu_name, "triton": ".".join(triton_version.split(".")[:2]), "measured": measured,
            "configs": {str(k): fields(c) for k, c in sorted(table.items())}}
    if hopper_cfg is not None:
        data["hopper"] = fields(hopper_cfg)
    pathlib.Path(path).write_text(json.dumps(data, indent=1) + "\n")
