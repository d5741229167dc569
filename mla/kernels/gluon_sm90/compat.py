"""Gluon's names that moved between Triton releases, under one name each.

Gluon is experimental: the CTA-wide barrier is ``gl.thread_barrier`` in Triton 3.6 (the GPU
image) and ``gl.barrier`` in 3.9 (CPU CI, which compiles the kernel ahead of time); inside a
``warp_specialize`` partition it synchronizes that partition's warps only. cp.async is
``async_copy_global_to_shared`` in 3.6 and ``async_load`` in 3.9. A shared-memory view of another
type is a descriptor's ``_reinterpret`` in 3.6 and ``reinterpret`` in 3.9.
"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core as _gl_core
from triton.experimental.gluon.language.nvidia.ampere import async_copy

cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@_gl_core.builtin
def reinterpret(desc, dtype, shape, layout, _semantic=None):
    """A shared-memory view of ``desc`` with another dtype, shape and layout."""
    return _semantic.memdesc_reinterpret(desc, _gl_core._unwrap_if_constexpr(dtype),
                                         [_gl_core._unwrap_if_constexpr(d) for d in shape],
                                         _gl_core._unwrap_if_constexpr(layout))
