"""The public entry points, with FlashMLA's argument names and checks: :func:`plan` decides a
call once, :func:`sparse_decode` runs it.

A plan holds everything that depends only on the shapes, the flags and the device: the impl,
the kernel with its form, config and split count (:mod:`mla.dispatch`), and the split
partials' workspace. It checks the inputs once; a call with the plan checks only that its
arguments are consistent with it (a cheap comparison of shapes, strides, dtypes and devices)
and that its caches fit their storage, and launches. A call without a plan finds one in a small
cache keyed on the same facts.

A plan never depends on an address: the layers of a step, whose caches are views of one pool
at different offsets, share one plan. What an address decides is checked per call: a cache
view must fit its storage (:func:`planned_call`), and a Gluon plan's caches must start at
multiples of 16 bytes (:class:`mla.dispatch.Launcher`; a plan made for a cache that does not
runs the ``tl.dot`` kernel, which reads any address).
"""
from __future__ import annotations

import collections
import dataclasses
import math

import torch

from . import _runtime, configs, dispatch
from .kernels import writer
from .layout import D_QK, D_V, PAST_STORAGE, TOKEN_BYTES, V32, check_cache, fail, layout_for_head_dim, span_bytes
from .reference import sparse_decode_reference, sparse_prefill_reference

IMPLS = ("auto", "mma", "simt", "reference")
MAX_HEADS = 128
#: the arguments, in the order of a call's signature (:func:`_signature`)
_SIGNATURE_ARGS = ("q", "k_cache", "indices", "softmax_scale", "attn_sink", "topk_length", "extra_k_cache",
                   "extra_indices", "extra_topk_length")


def _check_layout(t, arg, last_contiguous=True):
    """The ValueError naming ``arg`` for a layout the kernels cannot read in place: a last dim
    that is not contiguous (as FlashMLA asks), or strides whose elements overlap (a stride 0, or
    one shorter than the extent of the smaller ones)."""
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(arg, f"the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")
    reach = 0
    for st, n in sorted((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] > 1):
        if st <= reach:
            fail(arg, f"strides {tuple(t.stride())} of shape {tuple(t.shape)} make elements overlap: each must "
                      "be positive and past the extent of the smaller ones")
        reach += st * (n - 1)


def _check_indices(ind, arg, b, s_q, device):
    if not isinstance(ind, torch.Tensor):
        fail(arg, f"expected a torch.Tensor, got {type(ind).__name__}")
    if ind.dtype != torch.int32:
        fail(arg, f"expected dtype torch.int32, got {ind.dtype}")
    if ind.dim() != 3:
        fail(arg, f"expected rank 3 [b, s_q, topk], got rank {ind.dim()}")
    if ind.shape[0] != b or ind.shape[1] != s_q:
        fail(arg, f"batch/s_q mismatch: expected [{b}, {s_q}, topk] to match q, got {tuple(ind.shape)}")
    if ind.shape[2] < 1:
        fail(arg, "topk must be >= 1")
    if ind.device != device:
        fail(arg, f"device mismatch: on {ind.device}, q is on {device}")
    _check_layout(ind, arg)


def _check_vector(t, arg, n, dtype, what, device):
    if not isinstance(t, torch.Tensor):
        fail(arg, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        fail(arg, f"expected dtype {dtype}, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != n:
        fail(arg, f"expected shape [{what}] = [{n}], got {tuple(t.shape)}")
    if t.device != device:
        fail(arg, f"device mismatch: on {t.device}, q is on {device}")
    _check_layout(t, arg, last_contiguous=False)


def _check_scale(value, arg):
    if isinstance(value, (torch.Tensor, bool)) or not isinstance(value, (int, float)):
        fail(arg, f"expected a Python float, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        fail(arg, f"expected a finite float > 0, got {value!r}")


def check_inputs(q, k_cache, indices, softmax_scale=None, attn_sink=None, topk_length=None,
                 extra_k_cache=None, extra_indices=None, extra_topk_length=None, impl="auto"):
    """Every argument check of the contract; raises ValueError naming the argument. q's head dim
    names the cache layout (512: MODEL1, 576: V3.2, :func:`mla.layout.layout_for_head_dim`);
    both caches must be of that layout, as FlashMLA asks."""
    if impl not in IMPLS:
        fail("impl", f"expected one of {IMPLS}, got {impl!r}")
    if not isinstance(q, torch.Tensor):
        fail("q", f"expected a torch.Tensor, got {type(q).__name__}")
    if q.dtype != torch.bfloat16:
        fail("q", f"expected dtype torch.bfloat16, got {q.dtype}")
    if q.dim() != 4:
        fail("q", f"expected rank 4 [b, s_q, h_q, {D_QK}] (576 for V3.2), got rank {q.dim()}")
    b, s_q, h_q, d = q.shape
    layout = layout_for_head_dim(d, "q")
    if b < 1 or s_q < 1:
        fail("q", f"expected b >= 1 and s_q >= 1, got shape {tuple(q.shape)}")
    if not 1 <= h_q <= MAX_HEADS:
        fail("q", f"expected 1 <= h_q <= {MAX_HEADS}, got {h_q}")
    _check_layout(q, "q")
    dev = q.device
    check_cache(k_cache, "k_cache", layout)
    if k_cache.device != dev:
        fail("k_cache", f"device mismatch: on {k_cache.device}, q is on {dev}")
    _check_indices(indices, "indices", b, s_q, dev)
    if softmax_scale is not None:
        _check_scale(softmax_scale, "softmax_scale")
    if attn_sink is not None:
        _check_vector(attn_sink, "attn_sink", h_q, torch.float32, "h_q", dev)
    if topk_length is not None:
        _check_vector(topk_length, "topk_length", b, torch.int32, "b", dev)
    has_extra = [x is not None for x in (extra_k_cache, extra_indices)]
    if any(has_extra) and not all(has_extra):
        fail("extra_k_cache" if not has_extra[0] else "extra_indices",
             "extra_k_cache and extra_indices must be given together")
    if extra_topk_length is not None and extra_indices is None:
        fail("extra_topk_length", "given without extra_k_cache and extra_indices")
    if extra_k_cache is not None:
        check_cache(extra_k_cache, "extra_k_cache", layout)
        if extra_k_cache.device != dev:
            fail("extra_k_cache", f"device mismatch: on {extra_k_cache.device}, q is on {dev}")
        _check_indices(extra_indices, "extra_indices", b, s_q, dev)
        if extra_topk_length is not None:
            _check_vector(extra_topk_length, "extra_topk_length", b, torch.int32, "b", dev)


def resolve_impl(impl: str, device: torch.device) -> str:
    """``"auto"`` is ``"mma"`` wherever the Triton kernels run (a CUDA device, or any device under
    Triton's CPU interpreter) and ``"reference"`` (plain PyTorch) elsewhere: CPU tensors on a
    machine whose Triton compiles for its GPU."""
    if impl != "auto":
        return impl
    return "mma" if device.type == "cuda" or _runtime.INTERPRET else "reference"


def signature(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
               extra_topk_length) -> tuple:
    """What a plan is made for, one entry per argument: shapes, strides (the caches' page strides
    among them), dtypes and devices, and the scale with its type; no address, so the caches of
    every layer, views of one pool at different offsets, have one signature. Building it is the
    whole check of a planned call but the storage one (:func:`planned_call`), so it is written
    out flat."""
    e = extra_k_cache
    return ((q.shape, q.stride(), q.dtype, q.device),
            (k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device),
            (indices.shape, indices.stride(), indices.dtype, indices.device), (type(softmax_scale), softmax_scale),
            None if attn_sink is None else (attn_sink.shape, attn_sink.stride(), attn_sink.dtype, attn_sink.device),
            None if topk_length is None else (topk_length.shape, topk_length.stride(), topk_length.dtype,
                                              topk_length.device),
            None if e is None else (e.shape, e.stride(), e.dtype, e.device),
            None if extra_indices is None else (extra_indices.shape, extra_indices.stride(), extra_indices.dtype,
                                                extra_indices.device),
            None if extra_topk_length is None else (extra_topk_length.shape, extra_topk_length.stride(),
                                                    extra_topk_length.dtype, extra_topk_length.device))


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A decided call (:func:`plan`): the impl and, for ``"mma"``, the launch (kernel, form,
    config, schedule: ``plan.launch``), for every call whose arguments have the shapes, strides,
    dtypes and devices it was made for, wherever its caches are. A plan made by :func:`plan`
    owns its split workspace, reused by every call: calls with one plan must run in order on one
    stream, as the layers of a decode step do."""

    impl: str
    signature: tuple
    launcher: dispatch.Launcher | None = None
    workspace: tuple = (None, None, None)
    #: what a call's fresh ``out`` and ``lse`` are made like (:func:`_output_templates`)
    outputs: tuple = ()
    #: the bytes each cache spans (:func:`mla.layout.span_bytes`; 0 for no extra cache), which a
    #: call's caches must find in their storage past their offsets
    spans: tuple = (0, 0)

    @property
    def launch(self) -> dispatch.Launch | None:
        """The kernel, its config and form, and the schedule (None unless ``impl="mma"``)."""
        return None if self.launcher is None else self.launcher.launch

    @property
    def q_shape(self) -> torch.Size:
        return self.signature[0][0]

    @property
    def device(self) -> torch.device:
        return self.signature[0][3]

    def fits(self, q, k_cache, indices, *, softmax_scale=None, attn_sink=None, topk_length=None,
             extra_k_cache=None, extra_indices=None, extra_topk_length=None) -> bool:
        """Whether a call with these arguments may use this plan (:func:`sparse_decode` raises a
        ValueError naming the first argument that does not fit)."""
        try:
            return signature(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache,
                              extra_indices, extra_topk_length) == self.signature
        except (AttributeError, TypeError, IndexError):
            return False

    def __repr__(self):
        b, s_q, h_q, _ = self.q_shape
        what = self.impl if self.launch is None else self.launch.label
        return f"Plan(b={b}, s_q={s_q}, h_q={h_q}, topk={self.signature[2][0][2]}: {what})"


def _output_templates(b: int, s_q: int, h_q: int, device) -> tuple:
    """Stand-ins of one element for a call's ``out`` and ``lse``, expanded to their shapes:
    ``torch.empty_like`` of one makes a contiguous tensor of that shape, dtype and device (an
    expanded tensor overlaps, so its strides are not kept), with less argument parsing per call
    than ``torch.empty(*shape, dtype=..., device=...)``."""
    return (torch.empty((), dtype=torch.bfloat16, device=device).expand(b, s_q, h_q, D_V),
            torch.empty((), dtype=torch.float32, device=device).expand(b, h_q, s_q))


def _make_plan(sig, q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
               extra_topk_length, impl, config, programs, own_workspace, isa=0) -> Plan:
    check_inputs(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
                 extra_topk_length, impl)
    impl = resolve_impl(impl, q.device)
    b, s_q, h_q, d_qk = q.shape
    outputs = _output_templates(b, s_q, h_q, q.device)
    spans = (span_bytes(k_cache), 0 if extra_k_cache is None else span_bytes(extra_k_cache))
    if impl != "mma":
        if config is not None or programs is not None or isa:
            fail("config" if config is not None else "programs" if programs is not None else "isa",
                 f"only impl='mma' takes a config; got impl={impl!r}")
        return Plan(impl, sig, outputs=outputs, spans=spans)
    extra_topk = extra_indices.shape[-1] if extra_k_cache is not None else 0
    align = dispatch.gluon_align(k_cache, extra_k_cache)
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        fail("programs", f"expected an int >= 1, got {programs!r}")
    lengths = topk_length is not None or extra_topk_length is not None
    launch = dispatch.plan_launch(q.device, b, s_q, h_q, indices.shape[-1], extra_topk, align, lengths, config,
                                  programs, isa, layout_for_head_dim(d_qk))
    ws = dispatch.workspace(launch, b, s_q, h_q, q.device) if own_workspace else (None, None, None)
    launcher = dispatch.Launcher(launch, q, k_cache, indices, attn_sink, topk_length, extra_k_cache, extra_indices,
                                 extra_topk_length, softmax_scale)
    return Plan("mma", sig, launcher, ws, outputs, spans)


def plan(q, k_cache, indices, *, softmax_scale=None, attn_sink=None, topk_length=None, extra_k_cache=None,
         extra_indices=None, extra_topk_length=None, impl="auto", config=None, programs=None, isa=0) -> Plan:
    """Decide a call once: the arguments of :func:`sparse_decode` (their values are not read,
    only their shapes, strides, dtypes and devices), checked. ``config`` (a
    :class:`mla.configs.TlDotConfig` or :class:`mla.configs.GluonConfig`) and ``programs`` (the
    work list's shares; the two-consumer form's splits per query) force the launch, for tests
    and experiments; ``isa`` (80 or 89) runs the portable kernel as an A100 or an L40 compiles it,
    on this (newer) GPU (:mod:`mla.kernels.cross_arch`). Returns a :class:`Plan` for
    ``sparse_decode(..., plan=...)``."""
    sig = _signature_or_check(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache,
                              extra_indices, extra_topk_length, impl)
    return _make_plan(sig, q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
                      extra_topk_length, impl, config, programs, own_workspace=True, isa=isa)


def _signature_or_check(*args):
    """The call's signature, or the check's ValueError when an argument is not even a tensor."""
    try:
        return signature(*args[:9])
    except (AttributeError, TypeError, IndexError):
        check_inputs(*args)
        raise


_PLANS: collections.OrderedDict = collections.OrderedDict()
#: how many plans the unplanned path keeps (a serving loop has a handful of shapes per step)
PLAN_CACHE_SIZE = 64


def _cached_plan(sig, impl, args) -> Plan:
    key = (sig, impl)
    try:
        found = _PLANS.get(key)
    except TypeError:                     # an unhashable argument (a softmax_scale list, say)
        check_inputs(*args, impl)
        raise
    if found is None:
        found = _make_plan(sig, *args, impl, None, None, own_workspace=False)
        _PLANS[key] = found
        if len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return found


def _mismatch(plan_: Plan, sig: tuple):
    """The ValueError for a call that does not match its plan, naming the first argument that
    differs."""
    for arg, want, got in zip(_SIGNATURE_ARGS, plan_.signature, sig):
        if want != got:
            fail(arg, f"does not match the plan: the plan was made for {want!r}, the call has {got!r} "
                      "(make a plan for these arguments with mla.plan)")


def _check_output(t, arg, shape, dtype, device):
    """The ValueError for an ``out`` or ``lse`` buffer that does not fit the call."""
    if not isinstance(t, torch.Tensor):
        fail(arg, f"expected a torch.Tensor, got {type(t).__name__}")
    fail(arg, f"expected a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, got "
              f"{t.dtype} {tuple(t.shape)} on {t.device}" + ("" if t.is_contiguous() else ", not contiguous"))


def sparse_decode(q, k_cache, indices, *, softmax_scale=None, attn_sink=None, topk_length=None,
                  extra_k_cache=None, extra_indices=None, extra_topk_length=None, impl="auto", plan=None,
                  out=None, lse=None):
    """Sparse MLA decode over an FP8 paged cache (FlashMLA's semantics): DeepSeek-V4's MODEL1
    cache, or DeepSeek-V3.2's (q 576 wide, 656-byte tokens; V is the 512 nope columns).

    Args:
        q: ``[b, s_q, h_q, 512]`` bf16 queries (``[b, s_q, h_q, 576]`` for V3.2: the head dim
            names the layout).
        k_cache: ``[num_blocks, P, 1, 584]`` float8_e4m3fn (or uint8) MODEL1 cache
            (``[num_blocks, P, 1, 656]`` V3.2 cache, :mod:`mla.layout`).
        indices: ``[b, s_q, topk]`` int32 token indices ``block*P + offset``; any index
            outside ``[0, num_blocks*P)`` is invalid and never read.
        softmax_scale: defaults to ``d_qk**-0.5`` (``512**-0.5``; ``576**-0.5`` for V3.2).
        attn_sink: ``[h_q]`` fp32, one sink logit per head.
        topk_length: ``[b]`` int32; positions ``>= topk_length[b]`` are invalid.
        extra_k_cache, extra_indices, extra_topk_length: a second cache (its own P, the same
            layout) that shares the softmax.
        impl: ``"auto"``, ``"mma"`` (the tensor-core kernels: :mod:`mla.dispatch` picks the
            ``tl.dot`` or the Gluon one), ``"simt"`` or ``"reference"``.
        plan: a :class:`Plan` from :func:`mla.plan` for arguments of these shapes (a ValueError
            names the first that does not match); without one, a cached plan is used.
        out, lse: written in place when given (contiguous, of the shapes below).

    Returns:
        ``out`` ``[b, s_q, h_q, 512]`` bf16 and ``lse`` ``[b, h_q, s_q]`` fp32 (natural log,
        without the sink; ``+inf`` for a query with no valid token, whose ``out`` is 0).

    Under ``torch.compile`` the call is the custom op ``torch.ops.mla.sparse_decode`` (a plan,
    if given, is not used there: the op plans for itself).
    """
    if torch.compiler.is_compiling():
        r_out, r_lse = torch.ops.mla.sparse_decode(q, k_cache, indices, softmax_scale, attn_sink, topk_length,
                                                   extra_k_cache, extra_indices, extra_topk_length, impl)
        if out is not None:
            out.copy_(r_out)
            r_out = out
        if lse is not None:
            lse.copy_(r_lse)
            r_lse = lse
        return r_out, r_lse
    try:
        sig = signature(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
                         extra_topk_length)
    except (AttributeError, TypeError, IndexError):
        check_inputs(q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
                     extra_topk_length, impl)
        raise
    if plan is None:
        if impl not in IMPLS:
            fail("impl", f"expected one of {IMPLS}, got {impl!r}")
        plan = _cached_plan(sig, impl, (q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache,
                                        extra_indices, extra_topk_length))
    else:
        if not isinstance(plan, Plan):
            fail("plan", f"expected an mla.Plan (from mla.plan), got {type(plan).__name__}")
        if sig != plan.signature:
            _mismatch(plan, sig)
        if impl != "auto" and impl != plan.impl:
            fail("impl", f"the plan is for impl={plan.impl!r}, the call asks for {impl!r}")
    return planned_call(plan, sig, q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache,
                         extra_indices, extra_topk_length, out, lse)


def planned_call(plan, sig, q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache,
                  extra_indices, extra_topk_length, out, lse):
    """Run a call that matches ``plan`` (its signature ``sig`` already compared): the caches'
    storage, the output buffers, then the launches. The signature holds no offset, so this is
    where a view into a pool is checked to fit its storage (a storage resized after the plan was
    made, say)."""
    main_span, extra_span = plan.spans
    if k_cache.storage_offset() + main_span > k_cache.untyped_storage().nbytes():
        fail("k_cache", PAST_STORAGE)
    if extra_span and extra_k_cache.storage_offset() + extra_span > extra_k_cache.untyped_storage().nbytes():
        fail("extra_k_cache", PAST_STORAGE)
    q_shape, _, _, dev = sig[0]
    b, s_q, h_q, _ = q_shape
    out_shape = plan.outputs[0].shape
    if out is None:
        out = torch.empty_like(plan.outputs[0])
    elif not (isinstance(out, torch.Tensor) and out.shape == out_shape and out.dtype == torch.bfloat16
              and out.device == dev and out.is_contiguous()):
        _check_output(out, "out", out_shape, torch.bfloat16, dev)
    if lse is None:
        lse = torch.empty_like(plan.outputs[1])
    elif not (isinstance(lse, torch.Tensor) and lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32
              and lse.device == dev and lse.is_contiguous()):
        _check_output(lse, "lse", (b, h_q, s_q), torch.float32, dev)
    if plan.impl == "mma":
        plan.launcher(q, k_cache, indices, attn_sink, topk_length, extra_k_cache, extra_indices, extra_topk_length,
                      out, lse, *plan.workspace)
    else:
        args = (q, k_cache, indices, softmax_scale, attn_sink, topk_length, extra_k_cache, extra_indices,
                extra_topk_length)
        if plan.impl == "simt":
            dispatch.run_simt(*args, out, lse)
            return out, lse
        ref_out, ref_lse = sparse_decode_reference(*args, dtype=torch.float32)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
    return out, lse


def write_kv(kv, k_cache, slot_mapping) -> None:
    """Quantize new latent rows into their slots of a cache, in place.

    Args:
        kv: ``[N, 512]`` (or ``[N, 1, 512]``) bf16: the new tokens' latents; ``[N, 576]`` for a
            V3.2 cache (the width names the layout, as q's head dim does).
        k_cache: ``[num_blocks, P, 1, 584]`` float8_e4m3fn (or uint8) MODEL1 cache, or
            ``[num_blocks, P, 1, 656]`` V3.2 cache, any page stride (a view into a larger pool
            works).
        slot_mapping: ``[N]`` int32 or int64: row ``i`` goes to token ``block * P + offset =
            slot_mapping[i]``. A slot below 0, or at or past ``num_blocks * P``, is skipped:
            nothing is written for it (no host sync, so it cannot raise).

    Each written token's bytes (MODEL1: its 576-byte data row and 8-byte scale row; V3.2: its
    656 bytes) are those :func:`mla.quantize_kv` writes for the same values; no other byte of
    the cache changes. The
    values must be finite, as for ``quantize_kv``. Capturable in a CUDA graph. Under
    ``torch.compile`` it is the custom op ``torch.ops.mla.write_kv``.
    """
    if torch.compiler.is_compiling():
        torch.ops.mla.write_kv(kv, k_cache, slot_mapping)
        return
    if not isinstance(kv, torch.Tensor):
        fail("kv", f"expected a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype != torch.bfloat16:
        fail("kv", f"expected dtype torch.bfloat16, got {kv.dtype}")
    if kv.dim() == 3 and kv.shape[1] == 1:
        kv = kv[:, 0]
    if kv.dim() != 2:
        fail("kv", f"expected shape [N, {D_QK}] (or [N, 1, {D_QK}]; [N, 576] for V3.2), got {tuple(kv.shape)}")
    layout = check_cache(k_cache, "k_cache", layout_for_head_dim(kv.shape[1], "kv"))
    if not isinstance(slot_mapping, torch.Tensor):
        fail("slot_mapping", f"expected a torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        fail("slot_mapping", f"expected dtype torch.int32 or torch.int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != kv.shape[0]:
        fail("slot_mapping", f"expected shape [N] = [{kv.shape[0]}], got {tuple(slot_mapping.shape)}")
    for arg, t in (("k_cache", k_cache), ("slot_mapping", slot_mapping)):
        if t.device != kv.device:
            fail(arg, f"device mismatch: on {t.device}, kv is on {kv.device}")
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    writer.write_kv(kv, k_cache.view(torch.uint8), k_cache.stride(0), k_cache.shape[1], k_cache.shape[0],
                    slot_mapping.contiguous(), v32=layout is V32)


PREFILL_IMPLS = ("auto", "mma", "reference")
#: the head dims of the prefill's q and kv: DeepSeek-V4's 512 (V is all of it) and V3.2's 576 (V
#: is its first 512 columns)
PREFILL_D_QK = (512, 576)


def _check_tensor(t, arg, dtype, dims):
    """A tensor of ``dtype`` and rank ``len(dims)`` (``dims`` names them, for the message)."""
    if not isinstance(t, torch.Tensor):
        fail(arg, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        fail(arg, f"expected dtype {dtype}, got {t.dtype}")
    if t.dim() != len(dims):
        fail(arg, f"expected rank {len(dims)} [{', '.join(dims)}], got rank {t.dim()}")


def check_prefill_inputs(q, kv, indices, sm_scale, d_v=D_V, attn_sink=None, topk_length=None, out=None,
                         impl="auto"):
    """Every argument check of the sparse prefill (FlashMLA's ``sparse_fwd.h`` checks, as
    ValueErrors naming the argument): dtypes, ranks, shapes, d_qk 512 or 576, d_v 512, one KV head
    (FlashMLA's kernels assert h_kv == 1, so h_q is a multiple of it), 1 <= h_q <= 128, the sink
    and length shapes, the devices, and a last dim that is contiguous."""
    if impl not in PREFILL_IMPLS:
        fail("impl", f"expected one of {PREFILL_IMPLS}, got {impl!r}")
    _check_tensor(q, "q", torch.bfloat16, ("s_q", "h_q", "d_qk"))
    _check_layout(q, "q")
    s_q, h_q, d_qk = q.shape
    if d_qk not in PREFILL_D_QK:
        fail("q", f"expected head dim d_qk in {PREFILL_D_QK}, got {d_qk}")
    if s_q < 1:
        fail("q", f"expected s_q >= 1, got shape {tuple(q.shape)}")
    if not 1 <= h_q <= MAX_HEADS:
        fail("q", f"expected 1 <= h_q <= {MAX_HEADS}, got {h_q}")
    dev = q.device
    _check_tensor(kv, "kv", torch.bfloat16, ("s_kv", "h_kv", "d_qk"))
    _check_layout(kv, "kv")
    s_kv, h_kv, d_kv = kv.shape
    if d_kv != d_qk:
        fail("kv", f"head dim mismatch: kv has {d_kv}, q has {d_qk}")
    if h_kv < 1 or h_q % h_kv:
        fail("kv", f"h_q = {h_q} must be a multiple of h_kv = {h_kv}")
    if h_kv != 1:
        fail("kv", f"expected h_kv = 1 (one latent KV head, as FlashMLA's kernels assert), got {h_kv}")
    if s_kv < 1:
        fail("kv", f"expected s_kv >= 1, got shape {tuple(kv.shape)}")
    if kv.device != dev:
        fail("kv", f"device mismatch: on {kv.device}, q is on {dev}")
    _check_tensor(indices, "indices", torch.int32, ("s_q", "h_kv", "topk"))
    if indices.shape[0] != s_q or indices.shape[1] != h_kv:
        fail("indices", f"expected [s_q, h_kv, topk] = [{s_q}, {h_kv}, topk] to match q and kv, got "
                        f"{tuple(indices.shape)}")
    if indices.shape[2] < 1:
        fail("indices", "topk must be >= 1")
    if indices.device != dev:
        fail("indices", f"device mismatch: on {indices.device}, q is on {dev}")
    _check_layout(indices, "indices")
    _check_scale(sm_scale, "sm_scale")
    if isinstance(d_v, bool) or d_v != D_V:
        fail("d_v", f"must be {D_V}, got {d_v!r}")
    if attn_sink is not None:
        _check_vector(attn_sink, "attn_sink", h_q, torch.float32, "h_q", dev)
    if topk_length is not None:
        _check_vector(topk_length, "topk_length", s_q, torch.int32, "s_q", dev)
    if out is not None:
        _check_tensor(out, "out", torch.bfloat16, ("s_q", "h_q", str(D_V)))
        if out.shape != (s_q, h_q, D_V) or out.device != dev:
            fail("out", f"expected a torch.bfloat16 tensor of shape {(s_q, h_q, D_V)} on {dev}, got {out.dtype} "
                        f"{tuple(out.shape)} on {out.device}")
        _check_layout(out, "out")


def sparse_prefill(q, kv, indices, sm_scale, d_v=D_V, attn_sink=None, topk_length=None, *, out=None, impl="auto",
                   config=None):
    """Sparse MLA prefill over a bf16 ``kv`` (FlashMLA's ``flash_mla_sparse_fwd``: its arguments,
    checks and outputs, as ``tests/ref.py`` defines them).

    Args:
        q: ``[s_q, h_q, d_qk]`` bf16, d_qk 512 (DeepSeek-V4) or 576 (V3.2), 1 <= h_q <= 128.
        kv: ``[s_kv, 1, d_qk]`` bf16, one latent KV head; V is its first 512 columns.
        indices: ``[s_q, 1, topk]`` int32; an index below 0 or at or past s_kv is invalid and
            never read.
        sm_scale: the scale of q.k before the softmax.
        d_v: 512 (the only value FlashMLA takes).
        attn_sink: ``[h_q]`` fp32; the output is multiplied by ``1 / (1 + exp(sink - lse))``
            (+inf gives zeros, -inf no effect); lse and max_logits are not affected.
        topk_length: ``[s_q]`` int32; positions ``>= topk_length[s]`` are invalid (never read,
            whatever the rows they name hold).
        out: ``[s_q, h_q, 512]`` bf16, written in place when given (any strides with a
            contiguous last dim, such as a slice of a larger buffer).
        impl: ``"auto"``, ``"mma"`` (the Triton kernel, :mod:`mla.kernels.prefill`) or
            ``"reference"`` (plain PyTorch in float32).
        config: a :class:`mla.configs.PrefillConfig` to launch instead of the device's (tests,
            experiments; ``impl="mma"`` only).

    Returns:
        ``(out [s_q, h_q, 512] bf16, max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32)``:
        max_logits and lse are the max and the logsumexp of the scaled scores over the valid
        positions (natural log); a query head with no valid position gets out 0, max_logits
        -inf and lse +inf.
    """
    check_prefill_inputs(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, impl)
    impl = resolve_impl(impl, q.device)
    if config is not None and (impl != "mma" or not isinstance(config, configs.PrefillConfig)):
        fail("config", f"expected a mla.configs.PrefillConfig with impl 'mma', got {config!r} with impl {impl!r}")
    s_q, h_q, _ = q.shape
    if out is None:
        out = torch.empty(s_q, h_q, D_V, dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    if impl == "mma":
        dispatch.run_prefill(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse, config)
    else:
        ref_out, ref_max, ref_lse = sparse_prefill_reference(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                                             dtype=torch.float32)
        out.copy_(ref_out)
        max_logits.copy_(ref_max)
        lse.copy_(ref_lse)
    return out, max_logits, lse


__all__ = ["IMPLS", "MAX_HEADS", "PREFILL_IMPLS", "Plan", "TOKEN_BYTES", "check_cache", "check_inputs",
           "check_prefill_inputs", "plan", "resolve_impl", "sparse_decode", "sparse_prefill", "write_kv"]
