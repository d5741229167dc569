"""mla.bench on the CPU: the command line, the byte and FLOP counts, the record arithmetic, the
SPEC's shapes, the GPU slug and the comparison of two results, and the same for the sparse
prefill's mode. Nothing here times anything."""
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import mla
from mla import bench
from mla.layout import TOKEN_BYTES

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cli(*args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "mla.bench", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_cli_refuses_under_the_interpreter():
    # TRITON_INTERPRET=1 is what `import mla` sets on a machine with no GPU; set it here too, so
    # that the test means the same on a GPU box.
    p = _cli("--impl", "mma", "--shape", "DSA", "--b", "1", env_extra={"TRITON_INTERPRET": "1"})
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "refusing to run under Triton's CPU interpreter" in p.stderr
    assert "an interpreter timing means nothing" in p.stderr
    assert "wrote" not in p.stdout


def test_run_refuses_under_the_interpreter(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="interpreter"):
        bench.run(bench.spec_shapes()[:1], ("mma",), out_dir=str(tmp_path), progress=False)
    assert not any(tmp_path.iterdir())


def test_ceilings_refuse_a_cpu_device():
    # a CPU copy and matmul measured as "the card's ceilings" would put every kernel above the
    # roofline; the default device is the GPU and anything else is an error
    with pytest.raises(ValueError, match="CUDA device"):
        bench.ceilings("cpu")


def test_cli_help():
    p = _cli("--help")
    assert p.returncode == 0, p.stderr
    for flag in ("--impl", "--shape", "--b", "--out", "--name", "--pool-gb", "--repeat", "--no-eager",
                 "--compare", "--against", "--tol"):
        assert flag in p.stdout, flag
    assert "results/<gpu-slug>/<name>.json" in p.stdout


def test_cli_unknown_shape(capsys):
    assert bench.main(["--shape", "MHA"]) == 2
    assert "unknown shape" in capsys.readouterr().err


def test_traffic_and_flops_by_hand():
    # DSA, b=1: s_q 1, h_q 64, topk 2048, no extra cache.
    #   tokens  2048 * (584 cache bytes + 4 index bytes) = 1_204_224
    #   q       64 heads * 512 * 2 bytes (bf16)          =    65_536
    #   out     64 * 512 * 2                             =    65_536
    #   lse     64 * 4 (fp32)                            =       256
    #   total                                            = 1_335_552 bytes
    #   FLOP    2 * b*s_q*h_q*topk * (512 + 512) = 2 * 64 * 2048 * 1024 = 268_435_456
    s = bench.Shape("DSA", 1, 1, 64, 2048, 64)
    assert TOKEN_BYTES == 584
    assert bench.traffic_bytes(s) == 2048 * (584 + 4) + 64 * 512 * 2 + 64 * 512 * 2 + 64 * 4 == 1_335_552
    assert bench.flops(s) == 268_435_456
    # V4-CSA, b=32: topk 128 + extra 512 = 640 tokens per query, h_q 64.
    #   32 * (640 * 588 + 64 * (1024 + 1024 + 4)) = 32 * (376_320 + 131_328) = 16_244_736
    #   FLOP 2 * 32 * 64 * 640 * 1024 = 2_684_354_560
    v = bench.Shape("V4-CSA", 32, 1, 64, 128, 256, 512, 64)
    assert bench.traffic_bytes(v) == 16_244_736
    assert bench.flops(v) == 2_684_354_560
    # s_q 2 doubles both: each query token has its own index list.
    s2 = bench.Shape("DSA s_q 2", 1, 2, 64, 2048, 64)
    assert bench.traffic_bytes(s2) == 2 * bench.traffic_bytes(s)
    assert bench.flops(s2) == 2 * bench.flops(s)


def test_record_arithmetic():
    s = bench.Shape("DSA", 1, 1, 64, 2048, 64)          # 1_335_552 bytes, 268_435_456 FLOP
    # bytes decide: bytes / 4000 GB/s = 0.333888 us > FLOP / 5000 TFLOP/s = 0.053687 us. At t = 1 us:
    r = bench.record(s, "mma", 1.0, 1.2, {"copy_gbps": 4000.0, "matmul_tflops": 5000.0}, us_eager_loop=9.0)
    assert r["tflops"] == round(268_435_456 / 1e-6 / 1e12, 2) == 268.44
    assert r["gbps"] == round(1_335_552 / 1e-6 / 1e9, 1) == 1335.6
    assert r["roofline"] == round(0.333888 / 1.0, 4) == 0.3339
    assert (r["us_graph"], r["us_do_bench"], r["us_eager_loop"], r["impl"]) == (1.0, 1.2, 9.0, "mma")
    assert (r["shape"], r["b"], r["s_q"], r["h_q"], r["topk"], r["extra_topk"]) == ("DSA", 1, 1, 64, 2048, 0)
    # FLOP decide: FLOP / 1 TFLOP/s = 268.435456 us > bytes / 10000 GB/s = 0.1335552 us; t = 2x that
    r = bench.record(s, "simt", 536.870912, None, {"copy_gbps": 10000.0, "matmul_tflops": 1.0})
    assert r["roofline"] == 0.5
    assert r["us_do_bench"] is None and r["us_eager_loop"] is None
    assert r["tflops"] == 0.5
    # every field the contract's record schema names
    for k in ("shape", "b", "s_q", "h_q", "topk", "extra_topk", "impl", "us_graph", "us_do_bench", "us_eager_loop",
              "tflops", "gbps", "roofline"):
        assert k in r


def test_spec_shapes():
    got = [(s.name, s.b, s.s_q, s.h_q, s.topk, s.page, s.extra_topk, s.extra_page if s.extra_topk else None)
           for s in bench.spec_shapes()]
    want = [("DSA", b, 1, 64, 2048, 64, 0, None) for b in (1, 8, 32, 64, 128)]
    want += [("DSA s_q 2", 64, 2, 64, 2048, 64, 0, None)]
    want += [("V4-CSA", b, 1, 64, 128, 256, 512, 64) for b in (1, 32, 128)]
    want += [("V4-TP8", b, 1, 8, 128, 256, 512, 64) for b in (1, 32, 128)]
    assert got == want and len(got) == 12


def test_peers_are_the_spec_table():
    peers = bench.PEERS_H200_US
    assert set(peers) == {"FlashMLA sm90", "SGLang DSv4 Triton", "plain PyTorch"}
    assert peers["FlashMLA sm90"] is bench.FLASHMLA_H200_US
    assert peers["SGLang DSv4 Triton"] == {("DSA", 64): 3302, ("V4-CSA", 32): 559}
    assert peers["plain PyTorch"] == {("DSA", 64): 1173}
    keys = {(s.name, s.b) for s in bench.spec_shapes()}
    assert set(bench.FLASHMLA_H200_US) == keys              # FlashMLA at every SPEC shape
    for table in peers.values():
        assert set(table) <= keys
    # at TP8 FlashMLA pads 8 heads to 64: the V4-CSA time
    for b in (1, 32, 128):
        assert bench.FLASHMLA_H200_US[("V4-TP8", b)] == bench.FLASHMLA_H200_US[("V4-CSA", b)]


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA RTX 6000 Ada Generation", "rtx-6000"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA H200 NVL", "h200"), ("", "gpu")])
def test_gpu_slug(name, slug):
    assert bench.gpu_slug(name) == slug


def _rec(shape, b, impl, us, s_q=1, h_q=64):
    return {"shape": shape, "b": b, "s_q": s_q, "h_q": h_q, "impl": impl, "us_graph": us}


def test_compare_ratios(tmp_path, capsys):
    a = {"provenance": {}, "records": [_rec("DSA", 1, "mma", 20.0), _rec("DSA", 32, "mma", 80.0),
                                       _rec("DSA", 32, "simt", 6000.0), _rec("V4-TP8", 1, "mma", 10.0, h_q=8)]}
    b = [_rec("DSA", 32, "mma", 84.0), _rec("DSA", 1, "mma", 19.0), _rec("DSA", 32, "simt", 6600.0),
         _rec("DSA", 128, "mma", 240.0)]
    rows = bench.compare(a, b)
    assert [(r["shape"], r["b"], r["impl"]) for r in rows] == [("DSA", 1, "mma"), ("DSA", 32, "mma"),
                                                               ("DSA", 32, "simt")]   # A's order, both only
    assert [r["ratio"] for r in rows] == [0.95, 1.05, 1.1]                          # B / A
    assert [r["within"] for r in rows] == [True, True, False]                       # tol 5%
    assert [r["within"] for r in bench.compare(a, b, tol=0.2)] == [True] * 3
    assert rows[0]["us_a"] == 20.0 and rows[0]["us_b"] == 19.0
    # from files, and through the command line (exit 1: one case outside 5%)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps({"records": b}))
    assert bench.compare(str(pa), pb) == rows
    assert bench.main(["--compare", str(pa), str(pb)]) == 1
    out = capsys.readouterr().out
    assert "3 cases in both" in out and "1 outside 5%" in out
    assert bench.main(["--compare", str(pa), str(pa)]) == 0
    assert bench.main(["--compare", str(pa), str(pb), "--tol", "0.2"]) == 0
    assert bench.main(["--compare", str(pa), str(tmp_path / "missing.json")]) == 2


def test_compare_the_h200_record_with_itself():
    rec = ROOT / "results" / "h200" / "bench.json"
    rows = bench.compare(rec, rec)
    data = json.loads(rec.read_text())
    assert len(rows) == len(data["records"])
    assert all(r["ratio"] == 1.0 and r["within"] for r in rows)


def test_h200_record_is_consistent():
    """The committed record: SPEC schema, provenance, and derived numbers that match its times."""
    data = json.loads((ROOT / "results" / "h200" / "bench.json").read_text())
    prov = data["provenance"]
    for k in ("gpu", "sm_count", "driver", "torch", "triton", "commit", "date", "ceilings"):
        assert k in prov, k
    assert bench.gpu_slug(prov["gpu"]) == "h200"
    shapes = {(s.name, s.b): s for s in bench.spec_shapes()}
    for r in data["records"]:
        s = shapes[(r["shape"], r["b"])]
        ceil = prov.get("runs", {}).get(r.get("run"), prov)["ceilings"]
        again = bench.record(s, r["impl"], r["us_graph"], r.get("us_do_bench", r.get("us_eager")), ceil)
        for k in ("tflops", "gbps", "roofline"):
            assert math.isclose(again[k], r[k], rel_tol=0.01, abs_tol=0.01), (r, k, again[k])


def test_table_is_returned_not_printed(capsys):
    data = json.loads((ROOT / "results" / "h200" / "bench.json").read_text())
    text = bench.table(data["records"][:2])
    assert capsys.readouterr().out == ""
    assert f"{data['records'][0]['us_graph']:.1f}" in text and "FlashMLA" in text


def test_code_commit_names_the_head_and_marks_a_tree_that_differs_from_it(tmp_path, monkeypatch):
    """Provenance's commit: $MLA_COMMIT when set; else the short HEAD, with "+dirty" when tracked
    files differ from it (a tree timed before it was committed); "unknown" outside a checkout."""
    import shutil

    if shutil.which("git") is None:
        pytest.skip("no git")
    monkeypatch.delenv("MLA_COMMIT", raising=False)
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    assert bench.code_commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "k.py").write_text("x = 1\n")
    git("add", "k.py")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "k")
    head = git("rev-parse", "--short", "HEAD")
    assert bench.code_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked files do not count\n")
    assert bench.code_commit(tmp_path) == head
    (tmp_path / "k.py").write_text("x = 2\n")
    assert bench.code_commit(tmp_path) == head + "+dirty"
    monkeypatch.setenv("MLA_COMMIT", "abc1234")
    assert bench.code_commit(tmp_path) == "abc1234"


def test_the_flashmla_provenance_names_the_build_that_the_script_wrote(tmp_path, monkeypatch):
    pkg = tmp_path / "flash_mla"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.setattr(bench, "flash_mla", type(sys)("flash_mla"))
    bench.flash_mla.__file__ = str(pkg / "__init__.py")
    monkeypatch.setenv("FLASHMLA_COMMIT", "from-env")
    assert bench.flashmla_provenance()["commit"] == "from-env" and "build" not in bench.flashmla_provenance()
    build = {"commit": "9241ae3", "arch": "sm_90a", "registered": ["sparse_decode_fwd"]}
    (pkg / "BUILD_INFO.json").write_text(json.dumps(build))
    got = bench.flashmla_provenance()
    assert got["commit"] == "9241ae3" and got["build"] == build and got["path"] == str(pkg)


def test_the_flashmla_build_script_refuses_a_folder_that_is_not_a_flashmla_checkout(tmp_path):
    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "build_flashmla.sh"
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "SRC_DIR" in usage.stdout
    wrong = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True)
    assert wrong.returncode == 2 and "is not a FlashMLA checkout" in wrong.stderr
    (tmp_path / "csrc" / "api").mkdir(parents=True)
    (tmp_path / "csrc" / "api" / "sparse_decode.h").write_text("")
    old = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True)
    assert old.returncode == 2 and "has no csrc/smxx/decode" in old.stderr       # a tree it does not know


def test_eager_loops_take_turns_and_keep_each_ones_fastest(monkeypatch):
    """The eager loops of several calls alternate, round after round (one loop each), and each
    call's figure is its fastest loop: a slow spell slows whichever loop it falls on."""
    order, clock, made = [], [0.0], {"a": 0, "b": 0}
    cost = {"a": [1.0, 5.0, 2.0], "b": [7.0, 3.0, 4.0]}          # us a call, in each round

    def caller(name):
        def call(i):
            order.append((name, i))
            k, made[name] = made[name], made[name] + 1
            if k >= 2:                                           # past the warm-up (2 index sets)
                clock[0] += cost[name][(k - 2) // 4] * 1e-6      # 4 calls a loop
        return call
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    case = type("C", (), {"index_sets": [0, 1]})()
    got = bench.time_eager_loops(case, {"a": caller("a"), "b": caller("b")}, n_calls=4, reps=3)
    # the warm-up: each call on every index set; then rounds a, b, a, b, a, b of 4 calls each
    assert [n for n, _ in order] == ["a", "a", "b", "b"] + (["a"] * 4 + ["b"] * 4) * 3
    assert [i for n, i in order[4:8]] == [0, 1, 0, 1]
    assert got == pytest.approx({"a": 1.0, "b": 3.0})


def test_the_v32_sweep_counts_its_own_bytes_and_flops():
    """DeepSeek-V3.2's sweep points: 656-byte tokens and q 576 wide (Q.K over 576, P.V over 512),
    counted by hand; the records name the head dim."""
    s = next(x for x in bench.v32_sweep_shapes() if x.b == 8 and x.s_q == 1 and x.h_q == 64)
    assert (s.topk, s.page, s.d_qk, s.extra_topk, s.lengths) == (2048, 64, 576, 0, False)
    n_q = 8
    assert bench.traffic_bytes(s) == n_q * 2048 * (656 + 4) + n_q * 64 * (576 + 512) * 2 + n_q * 64 * 4
    assert bench.flops(s) == 2 * n_q * 64 * 2048 * (576 + 512)
    m1 = dataclasses.replace(s, d_qk=512)
    assert bench.flops(m1) == 2 * n_q * 64 * 2048 * 1024 and bench.traffic_bytes(m1) < bench.traffic_bytes(s)
    ceil = {"copy_gbps": 1000.0, "matmul_tflops": 100.0}
    assert bench.record(s, "mma", 10.0, None, ceil)["d_qk"] == 576 and "d_qk" not in bench.record(m1, "mma", 10.0,
                                                                                                   None, ceil)
    assert {(x.h_q, x.s_q) for x in bench.v32_sweep_shapes()} == {(64, 1), (64, 2), (128, 1), (128, 2)}


# ---------------------------------------------------------------------------------------------
# --prefill: the sparse prefill's timing (GPU only); its grid, arithmetic and records here
# ---------------------------------------------------------------------------------------------


def test_cli_prefill_refuses_under_the_interpreter(tmp_path):
    p = _cli("--prefill", "--out", str(tmp_path), env_extra={"TRITON_INTERPRET": "1"})
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "refusing to run under Triton's CPU interpreter" in p.stderr
    assert not any(tmp_path.iterdir())


def test_prefill_refuses_under_the_interpreter(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="interpreter"):
        bench.prefill(bench.prefill_shapes()[:1], ("mma",), out_dir=str(tmp_path), progress=False)
    assert not any(tmp_path.iterdir())


def test_cli_help_names_prefill():
    p = _cli("--help")
    assert p.returncode == 0 and "--prefill" in p.stdout and "prefill.json" in p.stdout


def test_prefill_grid():
    got = bench.prefill_shapes()
    keys = [(s.h_q, s.d_qk, s.topk, s.s_q, s.s_kv) for s in got]
    assert sorted(keys) == sorted((h, d, k, sq, skv) for h in (64, 128) for d in (512, 576) for k in (512, 1024, 2048)
                                  for sq in (1024, 4096) for skv in (8192, 32768))
    assert len(set(keys)) == 48
    flops = [bench.prefill_flops(s) for s in got]
    assert flops == sorted(flops)                      # a time budget cuts the costliest points
    assert got[-1] == bench.PrefillShape(4096, 32768, 128, 2048, 576)
    assert {s.name for s in got} == {"prefill V4", "prefill V3.2"}


def test_prefill_flops_and_bytes_by_hand():
    # FlashMLA's V3.2 performance case: s_q 4096, h_q 128, top-k 2048, d_qk 576
    #   FLOP   2 * 4096 * 128 * 2048 * (576 + 512)                     = 2_336_462_209_024
    #   bytes  32768 * 576 * 2               every kv row once         =    37_748_736
    #        + 4096 * 2048 * 4                indices                  =    33_554_432
    #        + 4096 * 128 * ((576 + 512) * 2 + 8)   q, out, max, lse   = 1_145_044_992
    s = bench.PrefillShape(4096, 32768, 128, 2048, 576)
    assert bench.prefill_flops(s) == 2_336_462_209_024
    assert bench.prefill_bytes(s) == 37_748_736 + 33_554_432 + 1_145_044_992
    # fewer gathered rows than the cache holds: only those can be read
    assert bench.prefill_bytes(bench.PrefillShape(2, 32768, 64, 512, 512)) == 1024 * 1024 + 2 * 512 * 4 + 2 * 64 * 2056
    # MODEL1 CONFIG1: h_q 64, top-k 512, d_qk 512: 2 * 4096 * 64 * 512 * 1024 = 274_877_906_944
    v4 = bench.PrefillShape(4096, 8192, 64, 512, 512)
    assert bench.prefill_flops(v4) == 274_877_906_944
    assert bench.prefill_bytes(v4) == 8192 * 1024 + 4096 * 512 * 4 + 4096 * 64 * 2056


def test_prefill_record_arithmetic_and_schema():
    s = bench.PrefillShape(4096, 8192, 64, 512, 512)          # 274_877_906_944 FLOP, 555_745_280 bytes
    # FLOP at 1000 TFLOP/s: 274.88 us; bytes at 4000 GB/s: 138.94 us; the floor is 274.88 us
    r = bench.prefill_record(s, "mma", 1000.0, 1100.0, {"copy_gbps": 4000.0, "matmul_tflops": 1000.0})
    assert r["tflops"] == round(274_877_906_944 / 1e-3 / 1e12, 2) == 274.88
    assert r["gbps"] == round(555_745_280 / 1e-3 / 1e9, 1) == 555.7
    assert r["roofline"] == round(274_877_906_944 / 1e15 / 1e-3, 4) == 0.2749
    assert set(r) == {"shape", "s_q", "s_kv", "h_q", "topk", "d_qk", "impl", "us_graph", "us_do_bench", "tflops",
                      "gbps", "roofline"}
    assert (r["shape"], r["us_graph"], r["us_do_bench"], r["impl"]) == ("prefill V4", 1000.0, 1100.0, "mma")


def test_prefill_case_on_the_cpu():
    # a case is built on any device; its indices are distinct per token and in range, and its
    # "mma" caller is mla.sparse_prefill on them; FlashMLA's needs its extension
    s = bench.PrefillShape(3, 100, 16, 64, 576)
    case = bench.PrefillCase(s, "cpu", n_sets=2)
    for idx in case.index_sets:
        assert idx.shape == (3, 1, 64) and idx.dtype == torch.int32
        assert all(len(set(row.tolist())) == 64 for row in idx[:, 0])
        assert int(idx.min()) >= 0 and int(idx.max()) < 100
    out, ml, lse = case.caller("mma")(1)
    want = mla.sparse_prefill(case.q, case.kv, case.index_sets[1], 576 ** -0.5, attn_sink=case.sink)
    assert all(torch.equal(a, b) for a, b in zip((out, ml, lse), want))
    assert case.caller("mma").config.dot == "float16" and case.caller("mma-bf16").config.dot == "bfloat16"
    if bench.flash_mla is None:
        with pytest.raises(RuntimeError, match="flash_mla"):
            case.caller("flashmla")
    with pytest.raises(ValueError, match="impl"):
        case.caller("simt")
