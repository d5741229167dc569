"""Triton kernels. ``AVAILABLE`` maps an impl name to its launcher."""
from .mma import mma_sparse_decode
from .simt import simt_sparse_decode

AVAILABLE: dict = {"simt": simt_sparse_decode, "mma": mma_sparse_decode}
