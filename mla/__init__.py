"""mla: a portable, FlashMLA-compatible sparse MLA decode for DeepSeek-V4's FP8 paged cache,
and FlashMLA's sparse prefill over a bf16 kv, written in Triton. See the book for how and why.

Layers, bottom up: :mod:`mla.layout` (the cache's bytes), :mod:`mla.reference` (the semantics in
PyTorch), :mod:`mla.kernels` and :mod:`mla.configs` (neither imports the other),
:mod:`mla.dispatch` (the launch rule), :mod:`mla.api` (plan, call, cache writer, sparse prefill);
:mod:`mla.ops` (the torch custom ops), :mod:`mla.flash_mla` (FlashMLA's own call), :mod:`mla.validate`,
:mod:`mla.bench`, :mod:`mla.aot` and :mod:`mla.tuning` above them.
"""
from . import _runtime  # noqa: F401  (must come first: it may turn on Triton's interpreter)
from ._runtime import HAS_CUDA, INTERPRET
from . import ops  # noqa: F401  (registers torch.ops.mla.sparse_decode and torch.ops.mla.write_kv)
from .api import Plan, check_inputs, plan, sparse_decode, sparse_prefill, write_kv
from .layout import dequantize_kv, page_stride, quantize_kv
from .reference import sparse_decode_reference, sparse_prefill_reference

__version__ = "0.2.0"
__all__ = ["sparse_decode", "sparse_prefill", "plan", "Plan", "write_kv", "quantize_kv", "dequantize_kv", "page_stride", "check_inputs",
           "sparse_decode_reference", "sparse_prefill_reference", "INTERPRET", "HAS_CUDA"]
