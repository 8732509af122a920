"""engine/profiling.py and the prefill worker's per-request profile, on the
CPU: wall time against the aten ops' own time, ops sorted into kinds."""
from __future__ import annotations

import gc
import re
import time

import pytest
import torch

from engine.profiling import Profile, Timeline, by_kind, kind_of, profiled
from kvstore.client import StoreClient
from prefill.runner import PrefillJob, run_prefill
from prefill.server import PrefillService, parser
from tests.test_kvstore_process import StoreProcess

CPU = torch.device("cpu")


def test_a_profile_separates_op_time_from_python_time():
    a = torch.randn(256, 256)
    with profiled(CPU) as profile:
        for _ in range(4):
            a = torch.tanh(a @ a)
        time.sleep(0.05)  # host time no op accounts for
    assert profile.wall_s >= 0.05
    assert profile.units["aten::mm"][0] == 4 and profile.units["aten::tanh"][0] == 4
    # own time: aten::matmul's time is in its aten::mm child, counted once
    assert 0 < profile.busy_s < profile.wall_s - 0.045
    assert profile.launches >= 8
    line = profile.describe()
    assert line.startswith(f"{1e3 * profile.wall_s:.0f} ms wall, aten ops")
    assert "gemm (cuBLAS)" in line and "aten::mm x4" in line


def test_kinds_of_kernel_and_op_names():
    assert kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm (cuBLAS)"
    assert kind_of("_paged_attention_kernel") == "attention"
    assert kind_of("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "gdn"
    assert kind_of("_rms_norm_kernel") == "fused (ours)"
    assert kind_of("aten::index_select") == "copy / index / cat"
    assert kind_of("some_unknown_thing") == "other"
    # our Triton kernels of each kind, as the H200's profiles named them
    assert kind_of("_gemv_dot_kernel") == kind_of("_gemv_x8_kernel") == "gemv (Triton int4/int8)"
    assert kind_of("tandem_q4_gemv") == "gemv (CUDA int4 DP4A)"
    assert kind_of("_gemm_kernel") == "gemm (Triton int4/int8)"
    assert kind_of("_rk4p_dense_kernel") == kind_of("_int8_read_kernel") == "kv read"
    assert kind_of("_k_page_kernel") == kind_of("_staging_write_kernel") == "kv write"
    kinds = by_kind({"aten::mm": [2, 30.0], "aten::addmm": [1, 10.0], "aten::tanh": [5, 50.0]})
    assert list(kinds) == ["elementwise", "gemm (cuBLAS)"]
    assert kinds["gemm (cuBLAS)"] == [3, 40.0]


def test_a_timeline_times_its_steps_and_the_collections_inside_them():
    steps = []
    with Timeline(torch.device("cpu")) as timeline:
        marked = timeline.marking(lambda: steps.append(1))
        time.sleep(0.02)
        marked()
        gc.collect()  # a full collection inside the second step
        marked()
    assert steps == [1, 1] and len(timeline.steps_s) == 2
    assert timeline.steps_s[0] >= 0.02 and timeline.collections >= 1
    assert 0 < timeline.gc_s <= timeline.steps_s[1]
    assert timeline.wall_s >= sum(timeline.steps_s)
    assert gc.callbacks.count(timeline._on_gc) == 0  # removed on exit
    text = timeline.describe()
    assert re.fullmatch(r"\d+ ms wall: 2 chunks of \d+ \+ \d+ ms, \d+ ms after; gc [\d.]+ ms in "
                        r"\d+ collections", text), text
    assert "SM clock" not in text  # no NVML off CUDA


def test_an_empty_profile_says_so():
    assert Profile(wall_s=0.002).describe() == "2 ms wall, no aten ops recorded"


def test_the_prefill_worker_profiles_a_request_when_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_PROFILE_PREFILL", raising=False)
    proc = StoreProcess(tmp_path, "--model", "tiny-llama", "--max-context-tokens", "256",
                        "--live-slots", "1").wait_serving()
    try:
        with StoreClient.connect(proc.socket, "prefill") as client:
            pages = client.allocate(pages=4).pages
            job = PrefillJob("r1", tuple(range(3, 50)), 16, tuple(pages), -1)
            quiet = PrefillService(client, chunk=16)
            with quiet._profiled(job, 0.0021) as timeline:
                assert timeline is None
                run_prefill(client.model, client.cache, job, 16)
            assert "r1" not in capsys.readouterr().err
            every_other = PrefillService(client, chunk=16, profile_every=2)
            for _ in range(2):
                with every_other._profiled(job, 0.0021) as timeline:
                    run_prefill(client.model, client.cache, job, 16,
                                timeline.marking(lambda: None))
            # the report runs on the worker's thread after the request
            every_other.gpu.submit(lambda: None).result()
            err = capsys.readouterr().err
            client.release(pages=pages)
    finally:
        assert proc.terminate() == 0
    # every request: its chunks' wall times (31 new tokens in chunks of 16: 2)
    lines = [line for line in err.splitlines()
             if line.startswith("prefill: request r1 (31 new tokens after 16): 2.1 ms from "
                                "arrival to its prefill; prefill ")]
    assert len(lines) == 2, err
    assert all(re.search(r" ms wall: 2 chunks of \d+ \+ \d+ ms, \d+ ms after; gc [\d.]+ ms in "
                         r"\d+ collections", line) for line in lines), lines
    # every second: the profiler's kernels (here aten ops) too
    assert "; profiled: " not in lines[0] and "aten ops" not in lines[0]
    assert "; profiled: " in lines[1] and "gemm (cuBLAS)" in lines[1]


@pytest.mark.parametrize("env,expected", [("", 0), ("0", 0), ("3", 3)])
def test_the_profile_flag_defaults_to_the_environment(monkeypatch, env, expected):
    monkeypatch.setenv("TANDEM_PROFILE_PREFILL", env)
    assert parser().parse_args(["--store", "s", "--socket", "p"]).profile_every == expected


def test_a_bad_profile_setting_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_PROFILE_PREFILL", "yes")
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["--store", "s", "--socket", "p"])
    assert exit_.value.code == 2
    assert "a request count (0 = none) is needed, got 'yes'" in capsys.readouterr().err
