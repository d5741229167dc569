"""The Hopper (sm_90) kernel, written in Gluon: the algorithm of :mod:`mla.kernels.tl_dot`, with
the schedule spelled out instead of left to the compiler.

Why a second kernel: the ``tl.dot`` kernel leaves the tensor cores idle while it gathers and
decodes (every wgmma wait drains the pipe), Triton lays Q.K^T out so that both warpgroups
compute the same S, and the gather's loads stall the warps that do the math. Here a producer
partition only copies raw cache bytes into a shared-memory ring (:mod:`.ring`), and consumer
warpgroups decode, compute S once and run the softmax and P.V (:mod:`.consumers`);
:mod:`.kernel` holds the program, its epilogue and its launch, :mod:`.compat` Gluon's names
that moved between Triton releases. :mod:`.cluster` is the 128-head form as a cluster of 2 CTAs,
imported on its own (by :mod:`mla.dispatch`): it needs Triton 3.9's Gluon.
"""
from . import kernel
from .kernel import gluon_decode_kernel, launch_options, launch_params, row_align

__all__ = ["gluon_decode_kernel", "kernel", "launch_options", "launch_params", "row_align"]
