"""The portable kernels as Triton compiles them for an older architecture, run on the GPU in hand.

An A100 (sm_80) or an L40 (sm_89) runs the kernel as Triton lowers it for that target: ``mma.sync``
instead of wgmma, the loads and the register allocation of that target, the FP8 decode in integer
arithmetic on sm_80. PTX is forward compatible, so the PTX Triton emits for sm_80 or sm_89,
assembled by ptxas for this GPU, runs here: the same instruction stream, with that target's
layouts and its registers, on this GPU's SMs and memory system (not that GPU's SM count, shared
memory per SM or DRAM). ``tl_dot_sm80``, ``gluon_portable_sm89`` and the like (module attributes,
made on first use) are the kernels as such JIT functions; the launch rule runs them for a plan made
with ``isa``.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile

from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from . import tl_dot

try:                       # Gluon: Triton 3.5 and newer
    from triton.experimental.gluon._runtime import GluonJITFunction

    from . import gluon_portable
except (ImportError, AttributeError):
    GluonJITFunction = gluon_portable = None

#: the architectures whose code can run on a newer GPU this way (sm_100 and sm_120 PTX use
#: instructions of their own and cannot be assembled for sm_90)
ISAS = (80, 86, 89)


def _ptxas(arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(arch)
    return tool.path if hasattr(tool, "path") else tool[0]


def assemble(ptx: str, arch: int) -> bytes:
    """The cubin of ``ptx`` (PTX of any older target) for sm_``arch`` (sm_90a from 90 on), by
    Triton's own ptxas."""
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([_ptxas(arch), f"--gpu-name={gpu}", src, "-o", out], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ptxas --gpu-name={gpu} failed on {ptx_target(ptx)} PTX:\n{done.stderr[-2000:]}")
        with open(out, "rb") as f:
            return f.read()


def ptx_target(ptx: str) -> str:
    """The ``.target`` a PTX module was written for (``sm_80``, ``sm_90a``, ...)."""
    m = re.search(r"^\s*\.target\s+(\w+)", ptx, re.M)
    return m.group(1) if m else "unknown"


class _CrossArch:
    """What makes a JIT function compile for target sm_``isa`` (specialized, like any other, from
    the call's arguments) and assemble the PTX for the GPU it launches on."""

    def _cross(self, isa: int):
        if isa not in ISAS:
            raise ValueError(f"isa: expected one of {ISAS}, got {isa!r}")
        self.isa, self.device_arch = isa, None

    def create_binder(self):
        kernel_cache, key_cache, target, _backend, _binder = super().create_binder()
        if target.arch <= self.isa:
            raise ValueError(f"isa: sm_{self.isa} code runs on a newer GPU only; this one is sm_{target.arch}")
        self.device_arch = target.arch
        target = GPUTarget(target.backend, self.isa, target.warp_size)
        backend = make_backend(target)
        self.compile = self._compile_and_assemble
        return kernel_cache, key_cache, target, backend, create_function_from_signature(self.signature, self.params,
                                                                                         backend)

    def _compile_and_assemble(self, src, target, options, **kw):
        compiled = triton_compile(src, target=target, options=options, **kw)
        cubin = assemble(compiled.asm["ptx"], self.device_arch)
        compiled.kernel = cubin
        try:
            compiled.asm["cubin"] = cubin
        except TypeError:       # a read-only view of the assembly in some Triton versions
            pass
        return compiled


class CrossArchJIT(_CrossArch, JITFunction):
    """A ``@triton.jit`` kernel compiled for sm_``isa`` (:class:`_CrossArch`)."""

    def __init__(self, jit_fn, isa: int, do_not_specialize=()):
        super().__init__(jit_fn.fn, do_not_specialize=list(do_not_specialize))
        self._cross(isa)


if GluonJITFunction is not None:
    class CrossArchGluonJIT(_CrossArch, GluonJITFunction):
        """A ``@gluon.jit`` kernel compiled for sm_``isa`` (:class:`_CrossArch`)."""

        def __init__(self, jit_fn, isa: int, do_not_specialize=()):
            super().__init__(jit_fn.fn, do_not_specialize=list(do_not_specialize))
            self._cross(isa)


@functools.lru_cache(maxsize=None)
def kernel(name: str, isa: int):
    """The decode kernel ``name`` (``tl_dot`` or ``gluon_portable``) as sm_``isa`` compiles it."""
    if name == "tl_dot":
        return CrossArchJIT(tl_dot.tl_dot_decode_kernel, isa, tl_dot.DO_NOT_SPECIALIZE)
    if name == "gluon_portable" and gluon_portable is not None:
        return CrossArchGluonJIT(gluon_portable.gluon_portable_kernel, isa, gluon_portable.DO_NOT_SPECIALIZE)
    raise ValueError(f"no kernel {name!r} to compile for another architecture")


def __getattr__(name: str):
    m = re.fullmatch(r"(tl_dot|gluon_portable)_sm(\d+)", name)
    if m and int(m.group(2)) in ISAS:
        return kernel(m.group(1), int(m.group(2)))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
