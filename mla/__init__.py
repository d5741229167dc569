"""mla: a portable, FlashMLA-compatible sparse MLA decode for DeepSeek-V4's FP8 paged cache,
written in Triton. See the book for how and why."""
from . import _runtime  # noqa: F401  (must come first: it may turn on Triton's interpreter)
from ._runtime import INTERPRET, HAS_CUDA
from .api import sparse_decode, check_inputs
from .layout import quantize_kv, dequantize_kv, page_stride
from .reference import sparse_decode_reference

__version__ = "0.1.0"
__all__ = ["sparse_decode", "quantize_kv", "dequantize_kv", "page_stride", "check_inputs",
           "sparse_decode_reference", "INTERPRET", "HAS_CUDA"]
