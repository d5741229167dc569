"""The serving stacks' own FlashMLA decode calls, on ``mla.flash_mla`` with nothing changed but
the import. Each test makes the call as the client's public source makes it (its argument names,
keyword or positional, the shapes and views of its tensors, the lifetime of its metadata
object), at small shapes for the CPU interpreter, and checks every call's outputs against
``mla.sparse_decode_reference`` with FlashMLA's tolerances (``mla.validate``). The step builders
here serve ``tests/test_gpu.py`` too, which captures the vLLM and SGLang steps in CUDA graphs.

The vLLM sparse backend's prefill (``flash_mla_sparse_fwd``) is not here: it is the prefill's.
"""
import inspect

import pytest
import torch
import torch.nn.functional as F

import mla
import mla.flash_mla as flash_mla
from mla import layout
from mla.validate import check_against_reference, make_case

from conftest import DEVICE as DEV, fill_with_latents, pool_views

TOKEN_BYTES = layout.TOKEN_BYTES
_CALL = inspect.signature(flash_mla.flash_mla_with_kvcache)


class Recorder:
    """``mla.flash_mla`` as a client imports it (``flash_mla.get_mla_metadata``,
    ``flash_mla.flash_mla_with_kvcache``), keeping each call's arguments by FlashMLA's names and
    what it returned, for :func:`check_calls`."""

    get_mla_metadata = staticmethod(flash_mla.get_mla_metadata)

    def __init__(self):
        self.calls = []

    def flash_mla_with_kvcache(self, *args, **kwargs):
        bound = _CALL.bind(*args, **kwargs)
        bound.apply_defaults()
        result = flash_mla.flash_mla_with_kvcache(*args, **kwargs)
        self.calls.append((dict(bound.arguments), result))
        return result


def reference_of(call: dict):
    """The float64 reference of one recorded call (FlashMLA's argument names to mla's)."""
    q = call["q"]
    scale = call["softmax_scale"] if call["softmax_scale"] is not None else q.shape[-1] ** -0.5
    return mla.sparse_decode_reference(q, call["k_cache"], call["indices"], scale, call["attn_sink"],
                                       call["topk_length"], call["extra_k_cache"], call["extra_indices_in_kvcache"],
                                       call["extra_topk_length"], out_dtype=torch.float64)


def check_calls(recorder: Recorder) -> None:
    """Every recorded call's (out, lse) against the reference, FlashMLA's whole check; where the
    call gave ``out=``, the returned out is that buffer."""
    assert recorder.calls
    for i, (call, (out, lse)) in enumerate(recorder.calls):
        if call.get("out") is not None:
            assert out is call["out"], f"call {i}: out= was not the buffer returned"
        out_ok, lse_ok = check_against_reference(out, lse, *reference_of(call))
        assert out_ok.ok and lse_ok.ok, (i, str(out_ok), str(lse_ok))


def window_indices(lengths, width, n_slots, gen, align=1):
    """[T, width rounded up to ``align``] int32: for token t, ``lengths[t]`` distinct slots of
    ``n_slots``, then -1 (the padding a server's index builders write)."""
    width = -(-width // align) * align
    idx = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for t, n in enumerate(lengths):
        idx[t, :n] = torch.randperm(n_slots, generator=gen)[:n].int()
    return idx


def uint8_pages(n_pages, page, device):
    """A pool's page buffer as SGLang allocates it: ``[pages, padded page bytes]`` uint8."""
    return torch.zeros(n_pages, mla.page_stride(page), dtype=torch.uint8, device=device)


# --- SGLang: DeepseekV4AttnBackend ----------------------------------------------------------



def sglang_step_inputs(device, seq_lens=(3, 40, 100), heads=8, window=32, c4_topk=64, ratios=(0, 4, 4),
                       swa_pages=8, c4_pages=4, c4_page=64, seed=0) -> dict:
    """What one SGLang V4 decode step holds: per layer its own page buffers (the SWA pool's, one
    page per ``window`` tokens, and for a C4 layer the compressed pool's, ``c4_page`` tokens a
    page: 256 // 4), the sinks; per step q ``[T, heads, 512]``, the SWA window's indices
    (``req_to_token`` through the window, -1 before the first token, padded to a multiple of 64
    with -1) and lengths ``clamp(seq_lens, max=window)``, the C4 indexer's top-k indices and
    lengths ``clamp(seq_lens // 4, 1, c4_topk)``."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for ratio in ratios:
        swa = uint8_pages(swa_pages, window, device)
        fill_with_latents(swa[:, :window * TOKEN_BYTES].view(swa_pages, window, TOKEN_BYTES), g)
        extra = None
        if ratio:
            extra = uint8_pages(c4_pages, c4_page, device)
            fill_with_latents(extra[:, :c4_page * TOKEN_BYTES].view(c4_pages, c4_page, TOKEN_BYTES), g)
        layers.append(dict(ratio=ratio, swa=swa, extra=extra, sink=torch.randn(heads, generator=g).to(device)))
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    swa_lens = torch.clamp(seq, max=window)
    c4_lens = torch.clamp(torch.clamp(seq // 4, min=1), max=c4_topk)
    return dict(
        layers=layers, window=window, c4_page=c4_page,
        q=torch.randn(len(seq_lens), heads, 512, generator=g).bfloat16().to(device),
        swa_page_indices=window_indices(swa_lens.tolist(), window, swa_pages * window, g, align=64).to(device),
        swa_topk_lengths=swa_lens.to(device),
        c4_sparse_page_indices=window_indices(c4_lens.tolist(), c4_topk, c4_pages * c4_page, g, align=64).to(device),
        c4_sparse_topk_lengths=c4_lens.to(device))


def sglang_metadata(flash_mla_module) -> dict:
    """The step's FlashMLA metadata, one per compress ratio (``DSV4AttnMetadata
    .init_flashmla_related``), shared by every layer of that ratio; SGLang makes them afresh for
    each step and again after a CUDA graph's warm-up."""
    return {ratio: flash_mla_module.get_mla_metadata()[0] for ratio in (0, 4)}


def sglang_layer(flash_mla_module, step, layer, metadata, softmax_scale=512 ** -0.5):
    """One layer's attention as ``DeepseekV4AttnBackend.forward`` calls FlashMLA: the pools' page
    buffers viewed as ``[pages, P, 1, 584]`` (the first ``P * 584`` bytes of each padded page), q
    and the 2-D index tensors given a unit s_q dim, every argument by keyword, out's s_q dim
    squeezed away; the lse is dropped."""
    swa = layer["swa"]
    swa_k_cache = swa[:, :step["window"] * TOKEN_BYTES].view(swa.shape[0], step["window"], 1, TOKEN_BYTES)
    extra_k_cache = extra_indices = extra_topk_lengths = None
    if layer["ratio"] == 4:
        extra, page = layer["extra"], step["c4_page"]
        extra_k_cache = extra[:, :page * TOKEN_BYTES].view(extra.shape[0], page, 1, TOKEN_BYTES)
        extra_indices = step["c4_sparse_page_indices"].unsqueeze(1)
        extra_topk_lengths = step["c4_sparse_topk_lengths"]
    o = flash_mla_module.flash_mla_with_kvcache(
        q=step["q"].unsqueeze(1),
        k_cache=swa_k_cache,
        head_dim_v=512,
        block_table=None,
        cache_seqlens=None,
        tile_scheduler_metadata=metadata[layer["ratio"]],
        softmax_scale=softmax_scale,
        is_fp8_kvcache=True,
        indices=step["swa_page_indices"].unsqueeze(1),
        topk_length=step["swa_topk_lengths"],
        attn_sink=layer["sink"],
        extra_k_cache=extra_k_cache,
        extra_indices_in_kvcache=extra_indices,
        extra_topk_length=extra_topk_lengths,
    )[0]
    return o.squeeze(1)


def sglang_step(flash_mla_module, step, metadata) -> list:
    """Every layer's attention in turn, as the model's forward runs them; their outputs."""
    return [sglang_layer(flash_mla_module, step, layer, metadata) for layer in step["layers"]]


def test_sglangs_v4_decode_step(plans_made):
    """SGLang's DeepSeek-V4 decode (sgl-project/sglang,
    python/sglang/srt/layers/attention/deepseek_v4_backend.py, DeepseekV4AttnBackend.forward, at
    9864fd124ccf22794627abc3c687617ff4b0a977): a SWA-only layer and two C4 layers, each with its
    own pool buffers, one metadata object per compress ratio shared by its layers; every call
    matches the reference, SGLang's squeezed out is the call's, and each metadata object made
    one plan."""
    step = sglang_step_inputs(DEV)
    recorder = Recorder()
    metadata = sglang_metadata(recorder)
    outs = sglang_step(recorder, step, metadata)
    check_calls(recorder)
    for o, (_, (out, _)) in zip(outs, recorder.calls):
        assert o.shape == (3, 8, 512) and torch.equal(o, out.squeeze(1))
    assert len(plans_made) == 2 and {id(m.plan) for m in metadata.values()} == {id(p) for p in plans_made}


# --- vLLM: DeepseekV4MLAAttention -----------------------------------------------------------



def vllm_step_inputs(device, seq_lens=(3, 40, 100), heads=8, padded_heads=64, window=32, topk=64,
                     ratios=(4, 4, 1), swa_blocks=8, c4_blocks=4, max_tokens=8, seed=0) -> dict:
    """What one vLLM V4 decode step holds: every layer's caches, the SWA one and (a C4A layer's)
    the compressed one, views ``[blocks, 64, 584]`` of ONE allocation at different offsets, 64
    tokens a block both (the SWA and C4A blocks share one tensor), with the padded page stride
    (the spec's 576-byte alignment); each layer's sink padded to ``padded_heads`` with -inf; per
    step q ``[T, heads, 512]``, the SWA indices and lengths as slices ``[:T]`` of the builder's
    persistent ``[max_tokens, 1, window]`` and ``[max_tokens]`` buffers (-1 past each length),
    and per C4A layer its global top-k ``[T, 1, topk]`` and lengths."""
    g = torch.Generator().manual_seed(seed)
    block, blocks, layers = 64, [], []
    for ratio in ratios:
        blocks += [swa_blocks, c4_blocks] if ratio == 4 else [swa_blocks]
    views = iter(pool_views(blocks, block, device, g))
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    t = len(seq_lens)
    c4_lens = torch.clamp(seq // 4, max=topk)
    for ratio in ratios:
        layer = dict(ratio=ratio, swa=next(views), kv=next(views) if ratio == 4 else None,
                     sink=F.pad(torch.randn(heads, generator=g), (0, padded_heads - heads),
                                value=float("-inf")).to(device))
        if ratio == 4:
            topk_indices = window_indices(c4_lens.tolist(), topk, c4_blocks * block, g)
            layer["topk_indices"] = topk_indices.view(t, 1, -1).to(device)
            layer["topk_lens"] = c4_lens.to(device)
        layers.append(layer)
    swa_lens = torch.clamp(seq, max=window)
    swa_indices = torch.zeros(max_tokens, 1, window, dtype=torch.int32, device=device)
    swa_indices[:t, 0] = window_indices(swa_lens.tolist(), window, swa_blocks * block, g).to(device)
    lens = torch.zeros(max_tokens, dtype=torch.int32, device=device)
    lens[:t] = swa_lens.to(device)
    return dict(layers=layers, padded_heads=padded_heads,
                q=torch.randn(t, heads, 512, generator=g).bfloat16().to(device),
                decode_swa_indices=swa_indices[:t], decode_swa_lens=lens[:t])


def vllm_metadata(flash_mla_module) -> dict:
    """The step's tile-scheduler metadata, one per layer type (``DeepseekSparseSWAMetadataBuilder
    .build_tile_scheduler``), fresh at every build and shared by the ~60 layers of its type."""
    return {ratio: flash_mla_module.get_mla_metadata()[0] for ratio in (1, 4)}


def vllm_forward_decode(flash_mla_module, layer, q, swa_indices, swa_lens, tile_metadata, output,
                        scale=512 ** -0.5) -> None:
    """``DeepseekV4MLAAttention._forward_decode``'s call: q ``[T, padded_heads, 512]`` given a
    unit s_q dim, the caches ``unsqueeze(-2)``'d (strides kept), every argument by keyword and
    the layer's output buffer as ``out=output.unsqueeze(1)``; the returned out and lse are
    dropped."""
    swa_only = layer["kv"] is None
    kv_cache = None if swa_only else layer["kv"].unsqueeze(-2)
    out, _ = flash_mla_module.flash_mla_with_kvcache(
        q=q.unsqueeze(1),
        k_cache=layer["swa"].unsqueeze(-2),
        block_table=None,
        head_dim_v=512,
        tile_scheduler_metadata=tile_metadata,
        cache_seqlens=None,
        is_fp8_kvcache=True,
        indices=swa_indices,
        topk_length=swa_lens,
        softmax_scale=scale,
        attn_sink=layer["sink"],
        extra_k_cache=kv_cache if not swa_only else None,
        extra_indices_in_kvcache=layer.get("topk_indices"),
        extra_topk_length=layer.get("topk_lens"),
        out=output.unsqueeze(1),
    )


def vllm_step(flash_mla_module, step, metadata) -> list:
    """The layers' decode as the attention wrapper runs it: an output buffer ``[T, padded_heads,
    512]`` per layer (``o_padded``), q padded with zero heads, the decode into ``o_padded[:T]``,
    then the real heads sliced off."""
    q, h = step["q"], step["q"].shape[1]
    outs = []
    for layer in step["layers"]:
        o_padded = torch.empty(q.shape[0], step["padded_heads"], 512, dtype=q.dtype, device=q.device)
        q_padded = F.pad(q, (0, 0, 0, step["padded_heads"] - h), value=0.0)
        vllm_forward_decode(flash_mla_module, layer, q_padded, step["decode_swa_indices"], step["decode_swa_lens"],
                            metadata[layer["ratio"]], o_padded[:q.shape[0]])
        outs.append(o_padded[:, :h])
    return outs


def test_vllms_v4_decode_step(plans_made):
    """vLLM's DeepSeek-V4 decode (vllm-project/vllm,
    vllm/model_executor/layers/deepseek_v4_attention.py, DeepseekV4MLAAttention._forward_decode,
    at 0a291a2e1074b13971361df76245548a4ea4a77d; DeepseekV4FlashMLASparseImpl._forward_decode of
    the sparse backend makes the same call in later commits): two C4A layers and a SWA-only one,
    every cache a view of one allocation, 8 heads padded to 64, out= the layer's buffer. Every
    call matches the reference, the buffer holds the result, and one plan serves each layer
    type although each layer's caches sit at other offsets."""
    step = vllm_step_inputs(DEV)
    recorder = Recorder()
    metadata = vllm_metadata(recorder)
    outs = vllm_step(recorder, step, metadata)
    check_calls(recorder)
    for o, (call, _) in zip(outs, recorder.calls):
        assert o.shape == (3, 8, 512) and torch.equal(o, call["out"][:, 0, :8])
    assert len(plans_made) == 2 and {id(m.plan) for m in metadata.values()} == {id(p) for p in plans_made}


# --- vLLM: the sparse FlashMLA backend (DeepSeek-V3.2's cache) --------------------------------

def v32_cache(kv):
    """FlashMLA's V3.2 FP8 cache of bf16 latents ``[blocks, P, 576]``: per token 512 FP8 bytes
    (4 tiles of 128), 4 float32 power-of-two scales, 64 bf16 rope values; ``[blocks, P, 656]``
    uint8, vLLM's ``fp8_ds_mla`` cache shape."""
    nb, p, _ = kv.shape
    tiles = kv[..., :512].float().unflatten(-1, (4, 128))
    scale = layout.ue8m0_scale(tiles.abs().amax(-1))
    fp8 = (tiles / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)
    return torch.cat([fp8, scale.contiguous().view(torch.uint8), kv[..., 512:].contiguous().view(torch.uint8)], -1)


def vllm_fp8_flash_mla_kernel(flash_mla_module, q, kv_c_and_k_pe_cache, topk_indices, kernel_metadata,
                              padded_num_heads, softmax_scale):
    """``FlashMLASparseImpl._fp8_flash_mla_kernel``: q padded to the decode kernel's 64 heads
    (``new_zeros`` and a copy), the cache as uint8 ``unsqueeze(-2)``'d, the builder's dummy block
    table and cache lengths passed beside the indices, every argument by keyword; out and lse
    sliced back to the real heads."""
    actual_num_heads = q.size(2)
    if actual_num_heads < padded_num_heads:
        q_padded = q.new_zeros((q.size(0), q.size(1), padded_num_heads, q.size(3)))
        q_padded[:, :, :actual_num_heads, :] = q
        q = q_padded
    kv_cache_uint8 = kv_c_and_k_pe_cache.view(torch.uint8)
    out, lse = flash_mla_module.flash_mla_with_kvcache(
        q=q,
        k_cache=kv_cache_uint8.unsqueeze(-2),
        block_table=kernel_metadata["dummy_block_table"],
        head_dim_v=512,
        cache_seqlens=kernel_metadata["cache_lens"],
        tile_scheduler_metadata=kernel_metadata["scheduler_metadata"],
        is_fp8_kvcache=True,
        indices=topk_indices,
        softmax_scale=softmax_scale,
    )
    return out[:, :, :actual_num_heads, :], lse[:, :actual_num_heads, :]


def test_vllms_sparse_backend_decode_on_the_v32_cache(plans_made):
    """vLLM's sparse FlashMLA backend's decode (vllm-project/vllm,
    vllm/v1/attention/backends/mla/flashmla_sparse.py, FlashMLASparseImpl._fp8_flash_mla_kernel
    via _forward_fp8_kv_separate_prefill_decode, at 008a0c31dc020099dd40e8a2b7d2bdb37699b047):
    DeepSeek-V3.2's 656-byte cache and 576-dim q, 16 heads padded to 64, the builder's dummy
    block table and cache lengths beside the indices (FlashMLA ignores them), one metadata
    object per step shared by the layers. Two layers' caches share one allocation."""
    g = torch.Generator().manual_seed(7)
    num_decodes, s_q, heads, topk, blocks, block = 2, 1, 16, 64, 4, 64
    max_num_seqs, max_model_len = 8, 4096
    pool = torch.zeros(2 * blocks * block * 656, dtype=torch.uint8, device=DEV)
    caches = []
    for i in range(2):
        c = pool[i * blocks * block * 656:(i + 1) * blocks * block * 656].view(blocks, block, 656)
        c.copy_(v32_cache(torch.randn(blocks, block, 576, generator=g).bfloat16()).to(DEV))
        caches.append(c)
    kernel_metadata = dict(       # FlashMLASparseMetadataBuilder._build_fp8_separate_prefill_decode
        scheduler_metadata=flash_mla.get_mla_metadata()[0],
        dummy_block_table=torch.empty((max_num_seqs, 1), dtype=torch.int32, device=DEV)[:num_decodes],
        cache_lens=torch.full((max_num_seqs,), max_model_len, dtype=torch.int32, device=DEV)[:num_decodes])
    q = torch.randn(num_decodes, s_q, heads, 576, generator=g).bfloat16().to(DEV)
    lengths = [10, 64]
    topk_indices = window_indices(lengths, topk, blocks * block, g).view(num_decodes, s_q, topk).to(DEV)
    recorder = Recorder()
    outs = [vllm_fp8_flash_mla_kernel(recorder, q, c, topk_indices, kernel_metadata, 64, 576 ** -0.5)
            for c in caches]
    check_calls(recorder)
    for (o, l), (_, (out, lse)) in zip(outs, recorder.calls):
        assert torch.equal(o, out[:, :, :heads]) and torch.equal(l, lse[:, :heads])
    assert len(plans_made) == 1


# --- FlashMLA's own decode test ---------------------------------------------------------------

@pytest.mark.parametrize("d_qk", [512, 576])
def test_flashmlas_own_decode_test_call(d_qk):
    """FlashMLA's decode test (deepseek-ai/FlashMLA, tests/lib.py, run_flash_mla_decode, as
    tests/test_flash_mla_sparse_decoding.py's test_flash_mla calls it, at
    9241ae3ef9bac614dd25e45e507e089f888280e0): all sixteen arguments positional, one metadata
    object from get_mla_metadata() per test case, filled by the first call and reused by the
    timed ones; by keyword too; on both caches (V3.2's: q 576 wide, the output 512). Every call
    matches the reference, and sparse_decode bit for bit."""
    case = make_case(b=2, s_q=2, h_q=5, topk=40, page=16, extra_topk=24, extra_page=8, lengths=True, seed=5,
                     device=DEV, d_qk=d_qk)
    recorder = Recorder()
    meta, _ = recorder.get_mla_metadata()
    assert not meta.have_initialized
    sm_scale = d_qk ** -0.5
    positional = (case["q"], case["k_cache"], None, None, 512, meta, None, sm_scale, False, True, case["indices"],
                  case["attn_sink"], case["extra_k_cache"], case["extra_indices"], case["topk_length"],
                  case["extra_topk_length"])
    out, lse = recorder.flash_mla_with_kvcache(*positional)
    assert meta.have_initialized and meta.config.h_q == 5 and meta.config.extra_topk == 24
    want = mla.sparse_decode(**case, softmax_scale=sm_scale)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    again = recorder.flash_mla_with_kvcache(*positional)          # later calls only check
    assert torch.equal(again[0], out)
    kw = recorder.flash_mla_with_kvcache(case["q"], case["k_cache"], None, None, 512, meta, is_fp8_kvcache=True,
                                         indices=case["indices"], attn_sink=case["attn_sink"],
                                         extra_k_cache=case["extra_k_cache"],
                                         extra_indices_in_kvcache=case["extra_indices"],
                                         topk_length=case["topk_length"], extra_topk_length=case["extra_topk_length"])
    assert torch.equal(kw[0], out)
    check_calls(recorder)
