"""GPU-only checks (skipped on the CPU). Run them on a GPU before calling a kernel done:
``pytest -m gpu``."""
import functools

import pytest
import torch

import mla
from mla.validate import make_case, run_case

pytestmark = pytest.mark.gpu

SHAPES = {
    "DSA b4": dict(b=4, s_q=1, h_q=64, topk=2048, page=64),
    "DSA s_q2": dict(b=2, s_q=2, h_q=64, topk=2048, page=64, lengths=True),
    "V4-CSA b8": dict(b=8, s_q=1, h_q=64, topk=128, page=256, extra_topk=512, extra_page=64),
    "V4-TP8 b8": dict(b=8, s_q=1, h_q=8, topk=128, page=256, extra_topk=512, extra_page=64, lengths=True),
    "odd P61 h20": dict(b=3, s_q=3, h_q=20, topk=100, page=61, extra_topk=77, extra_page=13, lengths=True),
    "h128": dict(b=2, s_q=1, h_q=128, topk=300, page=64, empty_query=True),
}


@pytest.mark.parametrize("impl", ["simt", "mma"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernels_on_gpu(impl, name):
    case = make_case(**SHAPES[name], device="cuda", seed=len(name))
    out_ok, lse_ok = run_case(functools.partial(mla.sparse_decode, impl=impl), case)
    assert out_ok.ok, str(out_ok)
    assert lse_ok.ok, str(lse_ok)


def test_mma_is_captured_in_a_cuda_graph_and_replayed_over_new_indices():
    case = make_case(b=4, s_q=1, h_q=64, topk=512, page=64, num_blocks=256, device="cuda", seed=1, invalid_frac=0.0)
    idx = case["indices"].clone()
    args = dict(case, indices=idx)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mla.sparse_decode(**args, impl="mma")          # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = mla.sparse_decode(**args, impl="mma")
    n = case["k_cache"].shape[0] * case["k_cache"].shape[1]
    for seed in range(3):
        new = torch.randint(0, n, idx.shape, dtype=torch.int32, device="cuda",
                            generator=torch.Generator("cuda").manual_seed(seed))
        idx.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        ref_o, ref_l = mla.sparse_decode_reference(**dict(case, indices=new), out_dtype=torch.float64)
        co, cl = mla.validate.check_against_reference(out, lse, ref_o, ref_l)
        assert co.ok and cl.ok, f"replay {seed}: {co} | {cl}"


def test_serving_calls_use_the_shipped_config_on_an_h200():
    if "H200" not in torch.cuda.get_device_name():
        pytest.skip("the shipped table is for the H200")
    from mla import configs

    assert configs.source() == "h200.json"
