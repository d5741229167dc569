"""The CUDA-graph check: a call captured once, replayed over new cache contents and indices."""
from __future__ import annotations

import torch

from ..api import sparse_decode
from ..layout import cache_layout, quantize_kv
from ..reference import sparse_decode_reference
from .cases import invalid_values
from .compare import check_against_reference


def graph_replay_check(case: dict, replays: int = 3, impl: str = "mma", invalid_frac: float = 0.05) -> dict:
    """Capture ``mla.sparse_decode(**case, impl=impl)`` in a CUDA graph, then, before each replay,
    write fresh random latents into the captured caches and new random indices (with
    ``invalid_frac`` invalid ones) into the captured index tensors (the main cache's, and the
    extra cache's when the case has one), and check the replay against the reference. Passing
    proves the call has no host sync and reads its caches and indices at replay time. Every
    replay's reference must be finite everywhere: a NaN-poisoned cache would make NaN agree
    with NaN and the check vacuous, so such a replay counts as failed."""
    args = dict(case, indices=case["indices"].clone(), k_cache=case["k_cache"].clone())
    pairs = [("k_cache", "indices")]
    if case.get("extra_k_cache") is not None:
        args.update(extra_indices=case["extra_indices"].clone(), extra_k_cache=case["extra_k_cache"].clone())
        pairs.append(("extra_k_cache", "extra_indices"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sparse_decode(**args, impl=impl)          # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_decode(**args, impl=impl)
    res = []
    for seed in range(replays):
        g = torch.Generator(device="cpu").manual_seed(1000 + seed)
        n_bad = 0
        for cache_key, idx_key in pairs:
            kc, idx = args[cache_key], args[idx_key]
            nblk, page = kc.shape[0], kc.shape[1]
            kinds = torch.tensor(invalid_values(nblk * page), dtype=torch.int32)
            kc.copy_(quantize_kv(torch.randn(nblk, page, cache_layout(kc).d_qk, generator=g).bfloat16()))
            new = torch.randint(0, nblk * page, idx.shape, dtype=torch.int32, generator=g)
            bad = torch.rand(idx.shape, generator=g) < invalid_frac
            idx.copy_(torch.where(bad, kinds[torch.randint(0, len(kinds), idx.shape, generator=g)], new))
            n_bad += int(bad.sum())
        graph.replay()
        torch.cuda.synchronize()
        ref = sparse_decode_reference(**args, out_dtype=torch.float64)   # it reads the inputs, never writes them
        finite = bool(torch.isfinite(ref[0]).all())
        co, cl = check_against_reference(out, lse, *ref)
        res.append({"replay": seed, "ok": co.ok and cl.ok and finite, "reference_finite": finite,
                    "invalid_indices": n_bad, "out": str(co), "lse": str(cl)})
    return {"ok": all(r["ok"] for r in res), "replays": res}
