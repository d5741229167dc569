"""The Triton kernels, one module each: :mod:`.simt` (the per-head baseline), :mod:`.tl_dot` (the
portable tensor-core kernel), :mod:`.gluon_sm90` (the Hopper kernel, in Gluon), :mod:`.combine`
(the split-K merge), :mod:`.prefill` (FlashMLA's sparse prefill over a bf16 kv), and
:mod:`.common`, the building blocks they share. Which one runs, and how, is :mod:`mla.dispatch`'s
decision."""
