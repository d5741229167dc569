"""``mla``'s calls as PyTorch custom ops, so that ``torch.compile`` traces a step that uses them
without a graph break: ``torch.ops.mla.sparse_decode`` (returns ``out`` and ``lse``) and
``torch.ops.mla.write_kv`` (mutates ``k_cache``), each with a fake implementation that gives the
outputs' shapes and dtypes. :func:`mla.sparse_decode` and :func:`mla.write_kv` call them by
themselves while being compiled."""
from __future__ import annotations

import torch

from . import api
from .layout import D_V


@torch.library.custom_op("mla::sparse_decode", mutates_args=())
def sparse_decode_op(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, softmax_scale: float | None = None,
                     attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                     extra_k_cache: torch.Tensor | None = None, extra_indices: torch.Tensor | None = None,
                     extra_topk_length: torch.Tensor | None = None,
                     impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    return api.sparse_decode(q, k_cache, indices, softmax_scale=softmax_scale, attn_sink=attn_sink,
                             topk_length=topk_length, extra_k_cache=extra_k_cache, extra_indices=extra_indices,
                             extra_topk_length=extra_topk_length, impl=impl)


@sparse_decode_op.register_fake
def _(q, k_cache, indices, softmax_scale=None, attn_sink=None, topk_length=None, extra_k_cache=None,
      extra_indices=None, extra_topk_length=None, impl="auto"):
    b, s_q, h_q, _ = q.shape
    return (q.new_empty(b, s_q, h_q, D_V, dtype=torch.bfloat16),             # V: 512 columns in both layouts
            q.new_empty(b, h_q, s_q, dtype=torch.float32))


@torch.library.custom_op("mla::write_kv", mutates_args=("k_cache",))
def write_kv_op(kv: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    api.write_kv(kv, k_cache, slot_mapping)


@write_kv_op.register_fake
def _(kv, k_cache, slot_mapping):
    return None
