"""CPU probe: which rounding of P keeps the sparse prefill inside FlashMLA's tolerance.

Models the prefill kernel's arithmetic (:mod:`mla.kernels.prefill`) in PyTorch, tile by tile:
tiles of 64 positions, the online softmax in the exp2 domain with the row sum in fp32, P and V
rounded to the dots' operand type (bf16, as FlashMLA's sm_90 kernel rounds P, or fp16, the
default) before P.V, accumulation in fp32, out rounded to bf16. Each model is checked against the
float64 reference with FlashMLA's prefill check (:func:`mla.validate.check_prefill_against_reference`)
on FlashMLA's kind of test data (values about 0.1) and on unit-variance data (a latent after its
RMSNorm), with sink and topk_length (so some tokens have a few valid positions only).

    python experiments/prefill_p_rounding.py [--out results/cpu/prefill_p_rounding.json]
"""
import argparse
import datetime
import json
import math
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mla  # noqa: E402, F401  (first: it may turn Triton's interpreter on)
import torch  # noqa: E402

from mla import bench  # noqa: E402
from mla.reference import sparse_prefill_reference  # noqa: E402
from mla.validate import check_prefill_against_reference, make_prefill_case  # noqa: E402

LOG2E = 1.4426950408889634
#: (name, make_prefill_case keywords) of the data
DATA = (("FlashMLA's test data (N(0, 1)/10 + offset), sm_scale 0.5", dict(value_scale=0.1, sm_scale=0.5)),
        ("unit variance, sm_scale 0.5", dict(value_scale=1.0, sm_scale=0.5)),
        ("unit variance, sm_scale 576**-0.5", dict(value_scale=1.0, sm_scale=576 ** -0.5)))
SHAPE = dict(s_q=100, s_kv=3000, topk=640, h_q=40, d_qk=576, sink=True, lengths=True)


def modelled_kernel(q, kv, indices, sm_scale, attn_sink, topk_length, dot, block_n=64):
    """(out bf16, max_logits, lse) as the kernel computes them with ``dot`` operands."""
    s_q, h_q, _ = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    out = torch.empty(s_q, h_q, 512)
    ml, lse = torch.empty(s_q, h_q), torch.empty(s_q, h_q)
    for s in range(s_q):
        n = topk if topk_length is None else max(0, min(topk, int(topk_length[s])))
        m, l, acc = torch.full((h_q,), -math.inf), torch.zeros(h_q), torch.zeros(h_q, 512)
        qs = q[s].to(dot).float()
        for t in range(0, n, block_n):
            idx = indices[s, 0, t:min(n, t + block_n)].long()
            valid = (idx >= 0) & (idx < s_kv)
            k = torch.where(valid[:, None], kv[idx.clamp(0, s_kv - 1), 0].to(dot).float(), torch.zeros(()))
            scores = torch.where(valid[None], (qs @ k.T) * (sm_scale * LOG2E), -math.inf)
            m_new = torch.maximum(m, scores.amax(1))
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
            alpha = torch.exp2(m - m_safe)
            p = torch.exp2(scores - m_safe[:, None])
            l = l * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p.to(dot).float() @ k[:, :512]
            m = m_new
        empty = l == 0
        l_safe = torch.where(empty, 1.0, l)
        ln_lse = (m + torch.log2(l_safe)) * math.log(2)
        f = 1 / l_safe
        if attn_sink is not None:
            f = f / (1 + torch.exp(attn_sink - torch.where(empty, 0.0, ln_lse)))
        out[s] = acc * f[:, None]
        ml[s] = torch.where(empty, -math.inf, m * math.log(2))
        lse[s] = torch.where(empty, math.inf, ln_lse)
    return out.bfloat16(), ml, lse


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, help="write the rows (JSON) here")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    rows = []
    for name, kw in DATA:
        case = make_prefill_case(**SHAPE, **kw, seed=a.seed)
        ref = sparse_prefill_reference(case["q"], case["kv"], case["indices"], case["sm_scale"],
                                       attn_sink=case["attn_sink"], topk_length=case["topk_length"],
                                       out_dtype=torch.float64)
        for dot in (torch.bfloat16, torch.float16):
            got = modelled_kernel(case["q"], case["kv"], case["indices"], case["sm_scale"], case["attn_sink"],
                                  case["topk_length"], dot)
            out_ok = check_prefill_against_reference(*got, *ref)[0]
            rows.append({"data": name, "dot": str(dot).removeprefix("torch."), "ok": out_ok.ok,
                         "outputs_past_tolerance": out_ok.n_bad, "outputs": got[0].numel(),
                         "worst_abs": out_ok.worst_abs, "cos_diff": out_ok.cos_diff})
            print(f"{name:58s} P as {rows[-1]['dot']:8s}: {out_ok}")
    if a.out:
        doc = {"provenance": {"commit": bench.code_commit(ROOT), "torch": torch.__version__,
                              "python": platform.python_version(), "seed": a.seed, "shape": SHAPE,
                              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
                              "note": "a PyTorch model of the kernel's rounding, on the CPU; no kernel runs"},
               "rows": rows}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
