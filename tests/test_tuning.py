"""mla.tuning: the mla side of every autotuner pitfall of chapter 5, and the shipped-config path."""
import dataclasses
import functools
import json
import logging
import pathlib

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

import mla
from experiments import autotune_demos as demos
from mla import aot, configs, tuning
from mla.configs import TlDotConfig
from mla.kernels import combine, tl_dot


@triton.jit
def _named_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


def _plain_function():
    pass


class _Launcher:
    def launch(self):
        pass


# --- 1. naming ------------------------------------------------------------------------------


def test_autotuner_has_no_name_which_is_the_pitfall():
    k = triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=["n"])(_named_kernel)
    assert isinstance(k, Autotuner)
    assert not hasattr(k, "__name__")
    assert tuning.kernel_name(k) == "_named_kernel"


def test_kernel_name_through_every_wrapper():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    heur = triton.heuristics({"BLOCK": lambda a: 16})(_named_kernel)
    stacks = {
        "jit": _named_kernel,
        "JITFunction": JITFunction(_named_kernel.fn),
        "InterpretedFunction": InterpretedFunction(_named_kernel.fn),
        "heuristics": heur,
        "autotune(heuristics)": triton.autotune(configs=[triton.Config({})], key=["n"])(heur),
        "autotune(jit)": triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=["n"])(_named_kernel),
        "partial(autotune.run)": functools.partial(
            triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=["n"])(_named_kernel).run, grid=(1,)),
    }
    for label, obj in stacks.items():
        assert tuning.kernel_name(obj) == "_named_kernel", label
    assert tuning.kernel_name(_plain_function) == "_plain_function"
    assert tuning.kernel_name(functools.partial(_plain_function)) == "_plain_function"
    assert tuning.kernel_name(_Launcher().launch) == "launch"
    assert tuning.kernel_name(functools.wraps(_plain_function)(lambda: None)) == "_plain_function"
    assert tuning.kernel_name(object()) == "object"
    assert tuning.kernel_name(tl_dot.tl_dot_decode_kernel) == "tl_dot_decode_kernel"


def test_kernel_name_stops_on_a_cycle():
    class Loop:
        pass

    a, b = Loop(), Loop()
    a.fn, b.fn = b, a
    assert tuning.kernel_name(a) == "Loop"


# --- 2. best_config / tuned_configs ---------------------------------------------------------


def test_tuned_configs_per_key_while_best_config_is_the_last_call(device):
    k = demos.make_scale(key=("n",), configs=demos.SCALE_CONFIGS, prune=demos.block_for_n,
                          do_bench=tuning.CountingBench())
    assert not hasattr(k, "best_config")
    assert tuning.tuned_configs(k) == {}
    for n in (50, 200):
        x = torch.arange(n, dtype=torch.float32, device=device)
        assert torch.equal(demos.scale(k, x), 2 * x)
    per_key = {key[0]: c.kwargs["BLOCK"] for key, c in tuning.tuned_configs(k).items()}
    assert per_key == {50: 64, 200: 256}
    assert k.best_config.kwargs["BLOCK"] == 256
    with pytest.raises(TypeError):
        tuning.tuned_configs(demos.scale_kernel)


# --- 3. reset_to_zero / restore_value -------------------------------------------------------


def test_reset_to_zero_fixes_the_split_k_demo(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 8, (4, 64), generator=g).float().to(device)
    ref = x.double().sum(1).float()
    counter = tuning.CountingBench()
    bad = demos.splitk_sum(demos.make_splitk_sum(False, demos.SPLITK_CONFIGS, counter), x)
    assert counter.calls == len(demos.SPLITK_CONFIGS)
    assert not torch.allclose(bad, ref)                       # benchmark runs accumulated
    good_kernel = demos.make_splitk_sum(True, demos.SPLITK_CONFIGS, tuning.CountingBench())
    assert torch.equal(demos.splitk_sum(good_kernel, x), ref)
    assert torch.equal(demos.splitk_sum(good_kernel, x), ref)  # tuned key: one launch, still exact


def test_restore_value_fixes_the_in_place_demo(device):
    vals = {}
    for restore in (None, ["y_ptr"]):
        x = torch.ones(100, device=device)
        demos.scale_(demos.make_scale(configs=demos.SCALE_CONFIGS, do_bench=tuning.CountingBench(),
                                        restore_value=restore), x)
        vals[bool(restore)] = x
    assert not torch.equal(vals[False], torch.full_like(vals[False], 2.0))
    assert torch.equal(vals[True], torch.full_like(vals[True], 2.0))


# --- 4. keys --------------------------------------------------------------------------------


def test_bucket():
    assert [tuning.bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 100, 1024, 1025)] == \
        [1, 1, 2, 4, 4, 8, 8, 16, 128, 1024, 2048]
    assert tuning.bucket(3, minimum=16) == 16
    assert tuning.bucket(1000, maximum=256) == 256
    assert len({tuning.bucket(n) for n in range(1, 129)}) == 8
    with pytest.raises(ValueError):
        tuning.bucket(-1)


def test_bucketed_key_retunes_once_per_power_of_two(device):
    tunings = {}
    for key in (("n",), ("n_key",)):
        counter = tuning.CountingBench()
        k = demos.make_scale(key=key, configs=demos.SCALE_CONFIGS, do_bench=counter)
        for n in range(1, 11):
            demos.scale(k, torch.ones(n, device=device))
        tunings[key[0]] = (len(tuning.tuned_configs(k)), counter.calls)
    assert tunings["n"] == (10, 10 * len(demos.SCALE_CONFIGS))
    assert tunings["n_key"] == (5, 5 * len(demos.SCALE_CONFIGS))     # buckets 1, 2, 4, 8, 16


# --- 5. shared-memory pruning ---------------------------------------------------------------


def test_shared_memory_pruner_logic_with_a_fake_report(monkeypatch, caplog):
    """The pruning decisions, without compiling: the report says one config is too big."""
    limit = aot.SMEM_LIMIT[120]
    calls = []

    def fake_report(variants, timeout=1800):
        calls.append(len(variants))
        return [{"shared": limit + 1 if v["num_stages"] == 2 else limit, "fits": v["num_stages"] != 2}
                if v["constexprs"]["BLOCK_N"] != 16 else {"error": "OutOfResources: fake"} for v in variants]

    monkeypatch.setattr(aot, "report", fake_report)
    monkeypatch.setattr(tuning, "_SMEM_REPORTS", {})
    one, two = TlDotConfig(num_stages=1), TlDotConfig(num_stages=2)
    broken = TlDotConfig(block_n=16)
    with caplog.at_level(logging.INFO, logger="mla"):
        assert tuning.prune_by_shared_memory([one, two, broken], 120) == [one]
    assert "shared memory" in caplog.text and "compile error" in caplog.text
    pruner = tuning.shared_memory_pruner(120)
    assert pruner([one, two], {}) == [one]
    assert calls == [1, 1, 1]                                 # each config compiled once per process
    with pytest.raises(ValueError):
        pruner([two], {})
    # triton.Config form, as an autotuner's early_config_prune would see it
    tc = [triton.Config({"BLOCK_H": 64, "BLOCK_N": 64}, num_warps=8, num_stages=s) for s in (1, 2)]
    assert tuning.prune_by_shared_memory(tc, 120) == tc[:1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prune_by_shared_memory_drops_a_config_that_does_not_fit_sm120():
    """Two real AOT compiles for sm_120 (99 KB): a small config fits, the H200's h_q-64 tile at
    two stages does not."""
    one = TlDotConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    two = dataclasses.replace(configs.table_for("NVIDIA H200", "3.6", 90)[1][64], num_stages=2)
    assert (two.block_h, two.block_n, two.num_warps) == (64, 64, 8)
    report = tuning.shared_memory([one, two], 120)
    assert all("error" not in r for r in report), report
    assert report[0]["shared"] <= aot.SMEM_LIMIT[120] < report[1]["shared"]
    assert tuning.prune_by_shared_memory([one, two], 120) == [one]


# --- 6. the interpreter ---------------------------------------------------------------------


def test_autotune_configs_single_config_under_the_interpreter():
    cfgs = tuning.autotune_configs(demos.SCALE_CONFIGS)
    if mla.INTERPRET:
        assert cfgs == demos.SCALE_CONFIGS[:1]
    else:
        assert cfgs == demos.SCALE_CONFIGS
    with pytest.raises(ValueError):
        tuning.autotune_configs([])


@pytest.mark.skipif(not mla.INTERPRET, reason="the failure is specific to the CPU interpreter")
def test_several_configs_fail_under_the_interpreter_and_one_works():
    x = torch.arange(10, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="0 active drivers"):
        demos.scale(demos.make_scale(configs=demos.SCALE_CONFIGS), x)
    k = demos.make_scale()                                       # autotune_configs: one config
    assert len(k.configs) == 1
    assert torch.equal(demos.scale(k, x), 2 * x)


# --- 7. warm-up before capture --------------------------------------------------------------


def test_warmup_keys_then_guard(device):
    k = demos.make_scale(configs=demos.SCALE_CONFIGS, do_bench=tuning.CountingBench())
    x = torch.ones(40, device=device)
    with pytest.raises(tuning.AutotuneInRegion, match="scale_kernel"):
        with tuning.autotune_guard("capture"):
            demos.scale(k, x)
    assert Autotuner._bench is not None and Autotuner._bench.__name__ == "_bench"      # restored
    assert tuning.warmup_keys(lambda n: demos.scale(k, torch.ones(n, device=device)), [40, 100]) == [40, 100]
    with tuning.autotune_guard("capture"):
        assert torch.equal(demos.scale(k, x), 2 * x)
        assert torch.equal(demos.scale(k, torch.ones(100, device=device)), torch.full((100,), 2.0, device=device))


@pytest.mark.gpu
def test_cuda_graph_capture_after_warmup(device):
    k = demos.make_scale(configs=demos.SCALE_CONFIGS)
    x = torch.ones(1 << 16, device=device)
    tuning.warmup_keys(lambda n: demos.scale(k, torch.ones(n, device=device)), [x.numel()])
    graph = torch.cuda.CUDAGraph()
    with tuning.autotune_guard("capture"), torch.cuda.graph(graph):
        y = demos.scale(k, x)
    x.copy_(torch.arange(x.numel(), dtype=torch.float32, device=device))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, 2 * x)


# --- 8. shipped configs: serving never autotunes -------------------------------------------


def test_table_for_h200_reads_the_shipped_file_and_unknown_gpu_gets_generic(monkeypatch, caplog):
    monkeypatch.delenv("MLA_CONFIG_FILE", raising=False)
    configs.table_for.cache_clear()
    shipped = json.loads((pathlib.Path(configs.__file__).with_name("h200.json")).read_text())
    with caplog.at_level(logging.INFO, logger="mla"):
        src, table = configs.table_for("NVIDIA H200", "3.6", 90)
        src_new, _ = configs.table_for("NVIDIA H200", "3.9.0", 90)
        src_unknown, generic = configs.table_for("NVIDIA GeForce RTX 5090", "3.6", 120)
    assert src == "h200.json" == src_new
    assert {str(k): v for k, v in table.items()} == {k: TlDotConfig(**v) for k, v in shipped["tl_dot"].items()}
    assert src_unknown == "generic" and generic == configs.generic(120)
    assert "configs from h200.json for NVIDIA H200" in caplog.text
    assert "tuned with Triton 3.6, running 3.9" in caplog.text
    assert "no shipped config for NVIDIA GeForce RTX 5090" in caplog.text
    configs.table_for.cache_clear()


def test_the_gluon_kernel_is_allowed_by_the_shipped_file_or_on_any_sm90_gpu(monkeypatch):
    monkeypatch.delenv("MLA_CONFIG_FILE", raising=False)
    configs.gluon_for.cache_clear()
    assert json.loads((pathlib.Path(configs.__file__).with_name("h200.json")).read_text())["gluon"] is True
    assert configs.gluon_for("NVIDIA H200", "3.6", 90) is True
    assert configs.gluon_for("NVIDIA H100 80GB HBM3", "3.6", 90) is True          # no file: any sm_90
    assert configs.gluon_for("NVIDIA GeForce RTX 5090", "3.6", 120) is False
    assert configs.gluon_for("NVIDIA A100-SXM4-80GB", "3.6", 80) is False
    configs.gluon_for.cache_clear()


def test_a_config_file_round_trips(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    table = {16: TlDotConfig(block_h=16), 64: TlDotConfig(num_stages=2, dv_halves=1)}
    configs.write(path, "NVIDIA X", "3.9.1", table, measured="by hand", gluon=False)
    monkeypatch.setenv("MLA_CONFIG_FILE", str(path))
    configs.table_for.cache_clear()
    configs.gluon_for.cache_clear()
    try:
        assert configs.table_for("NVIDIA X", "3.9", 90) == ("x.json", table)
        assert configs.gluon_for("NVIDIA X", "3.9", 90) is False
    finally:
        configs.table_for.cache_clear()
        configs.gluon_for.cache_clear()


def test_serving_call_never_autotunes(device, monkeypatch):
    assert tuning.find_autotuner(tl_dot.tl_dot_decode_kernel) is None
    assert tuning.find_autotuner(combine.combine_kernel) is None
    runs = []
    original = Autotuner.run
    monkeypatch.setattr(Autotuner, "run", lambda self, *a, **k: runs.append(self) or original(self, *a, **k))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 512, generator=g).bfloat16().to(device)
    cache = mla.quantize_kv(torch.randn(4, 16, 512, generator=g).bfloat16()).to(device)
    idx = torch.randperm(64, generator=g)[:16].view(1, 1, 16).int().to(device)
    with tuning.autotune_guard("a serving call"):
        out, lse = mla.sparse_decode(q, cache, idx, impl="mma")
    assert runs == []
    ref, ref_lse = mla.sparse_decode_reference(q, cache, idx)
    assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=2e-2)
    if device.type == "cuda" and torch.cuda.get_device_name() == "NVIDIA H200":
        assert configs.source() == "h200.json"
