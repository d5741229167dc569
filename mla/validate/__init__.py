"""Validation against the float64 reference with the SPEC's (FlashMLA's) tolerances.

Three lines validate your own sparse-decode function, one with the signature of
:func:`mla.sparse_decode` (``fn(q, k_cache, indices, *, softmax_scale, attn_sink, topk_length,
extra_k_cache, extra_indices, extra_topk_length) -> (out, lse)``)::

    import mla.validate as mv
    report = mv.validate(my_sparse_decode)      # every hard case, on the GPU when there is one
    assert report.ok, report                    # a table: each case, its worst element and where

What it checks, per case (:func:`make_case`, :class:`CaseSpec`):

- fresh random q and caches (quantized N(0, 1) latents) per case; indices with every kind of
  invalid entry (``-1``, INT32 min, INT32 max, ``num_blocks * P``); optional ``topk_length``
  (one of them 0), an extra cache with its own page size, a sink with ``+inf`` and ``-inf``
  entries, a query with no valid token at all;
- every cache byte that no valid index refers to is filled with NaN bytes (fp8 ``0x7F``, bf16
  and UE8M0 ``0xFF``), and the output memory is poisoned with NaN before the call;
- out and lse against the float64 reference on the dequantized cache with FlashMLA's whole
  check (:func:`check_against_reference`): out ``|err| < 1e-3`` or ``rel < 2.01/128``, lse
  ``|err| < 1e-6`` or ``rel < 8.01/65536``, the positions of inf and NaN exactly, and the cosine
  difference (:func:`cosine_diff`) at most 5e-6 for out and 1e-7 for lse; the worst element and
  its index are reported beside the cosine difference;
- dtypes (out bf16, lse fp32), no NaN anywhere, and (``leak_check``) that the answer is the same
  bit for bit when the unreferenced bytes hold zeros instead of NaN: nothing the call must not
  read may change what it returns.

The sparse prefill (FlashMLA's ``flash_mla_sparse_fwd``) has its own two:
:func:`make_prefill_case` draws inputs as FlashMLA's prefill test does (NaN in every kv row no
valid position names) and :func:`run_prefill_case` checks a call against the float64 reference
with FlashMLA's prefill tolerances (:func:`check_prefill_against_reference`).

:func:`sweep` runs several impls over many cases into a pandas DataFrame (one row per case and
impl, with a tqdm progress bar), :func:`table` renders it with rich, :func:`summary` condenses it.
Case sets: :func:`quick_cases` (tiny, for the CPU interpreter), :func:`odd_cases` (a pairwise
covering grid of odd shapes), :func:`schedule_cases` (the flat work list at production sizes), :func:`benchmark_cases` (the SPEC's production shapes over a large
pool), :func:`v32_cases` (DeepSeek-V3.2's cache at FlashMLA's V3.2 shapes), :func:`cases` (your own grid). ``experiments/broken_decodes.py`` holds deliberately
wrong implementations that the harness must catch.
"""
from .cases import (INVALID_KINDS, ODD_AXES, CaseSpec, benchmark_cases, cases, invalid_values, make_case, odd_cases,
                    schedule_cases, v32_cases,
                    poison_allocator, poison_unreferenced, quick_cases)
from .compare import (LSE_ABS, LSE_COS, LSE_REL, OUT_ABS, OUT_COS, OUT_REL, Closeness, check_against_reference,
                      check_prefill_against_reference, compare, cosine_diff)
from .graph import graph_replay_check
from .prefill import make_prefill_case, run_prefill_case
from .sweep import (ROW_COLUMNS, Report, check, run_case, summary, sweep, sweep_rows, table, unreferenced_invariant,
                    validate)

__all__ = ["OUT_ABS", "OUT_REL", "LSE_ABS", "LSE_REL", "OUT_COS", "LSE_COS", "Closeness", "cosine_diff", "compare",
           "check_against_reference", "check_prefill_against_reference", "INVALID_KINDS", "invalid_values",
           "poison_unreferenced", "make_case", "poison_allocator", "run_case", "CaseSpec", "cases", "quick_cases",
           "odd_cases", "schedule_cases", "v32_cases", "benchmark_cases",
           "ODD_AXES", "sweep", "sweep_rows", "check", "summary", "table", "Report", "validate",
           "unreferenced_invariant", "ROW_COLUMNS", "graph_replay_check", "make_prefill_case", "run_prefill_case"]
