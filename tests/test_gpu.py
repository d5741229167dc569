"""GPU-only checks (skipped on the CPU). Run them on a GPU before calling a kernel done:
``pytest -m gpu``."""
import functools

import pytest
import torch

import mla
from mla.kernels.mma import GLUON_FORMS
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


@pytest.mark.parametrize("variant", list(GLUON_FORMS))
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(SHAPES))
def test_gluon_kernel_on_gpu(name, splits, variant):
    """The sm_90 Gluon kernel's four forms (mla.kernels.mma.GLUON_FORMS), each forced on every
    shape (the launch rule picks heads as M for h_q > 16 on grids that fill the GPU, tokens as M
    for h_q <= 16)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90")
    from mla.kernels.mma import MMAConfig, mma_sparse_decode

    case = make_case(**SHAPES[name], device="cuda", seed=len(name))
    fn = functools.partial(mma_sparse_decode, config=MMAConfig(**GLUON_FORMS[variant]), splits=splits)
    out_ok, lse_ok = run_case(fn, case)
    assert out_ok.ok, str(out_ok)
    assert lse_ok.ok, str(lse_ok)


@pytest.mark.parametrize("extra,b,h_q", [(False, 16, 64), (True, 16, 64), (True, 128, 8), (False, 1, 64)])
def test_mma_is_captured_in_a_cuda_graph_and_replayed_over_new_indices(extra, b, h_q):
    # on an H200 the launch rule picks the Gluon kernel for each: b 16 x 8 or 10 tiles = 128 or
    # 160 programs, heads as M; 8 heads at b 128, 8 x 128-token tiles; b 1, tokens as M
    shape = dict(topk=128, page=256, extra_topk=512, extra_page=64) if extra else dict(topk=512, page=64)
    case = make_case(b=b, s_q=1, h_q=h_q, num_blocks=256, device="cuda", seed=1, invalid_frac=0.0, **shape)
    res = mla.validate.graph_replay_check(case, replays=3)
    assert res["ok"], res


def test_serving_calls_use_the_shipped_config_on_an_h200():
    if "H200" not in torch.cuda.get_device_name():
        pytest.skip("the shipped table is for the H200")
    from mla import configs

    assert configs.source() == "h200.json"
