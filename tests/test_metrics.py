"""Router metrics: updates appear in the exposition text, registries are per
object, the HTTP endpoint serves them, and the GPU collector is absent (never
an error) without NVML and labels processes by name with it."""
from __future__ import annotations

import os
import sys
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import GpuCollector, RouterMetrics, process_name


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics, name, **labels):
    return samples(metrics).get((name, tuple(sorted(labels.items()))))


def test_one_request_updates_every_series():
    m = RouterMetrics(gpu=False)
    m.request_started()
    assert value(m, "tandem_requests_running") == 1
    m.cache_query(query_tokens=100, hit_tokens=64)
    m.first_token(0.12)
    m.token(0.01)
    m.token(0.03)
    m.spec_decode(draft_tokens=6, accepted_tokens=4)
    m.set_kv_usage(used=10, total=4096)
    m.request_finished("stop", prompt_tokens=100, completion_tokens=3, cached_tokens=64,
                       latency=0.2)

    assert value(m, "tandem_requests_running") == 0
    assert value(m, "tandem_requests_total", finish_reason="stop") == 1
    assert value(m, "tandem_prompt_tokens_total") == 100
    assert value(m, "tandem_generation_tokens_total") == 3
    assert value(m, "tandem_prompt_tokens_cached_total") == 64
    assert value(m, "tandem_prefix_cache_queries_total") == 1
    assert value(m, "tandem_prefix_cache_query_tokens_total") == 100
    assert value(m, "tandem_prefix_cache_hit_tokens_total") == 64
    assert value(m, "tandem_spec_drafted_tokens_total") == 6
    assert value(m, "tandem_spec_accepted_tokens_total") == 4
    assert value(m, "tandem_kv_pages_used") == 10
    assert value(m, "tandem_kv_pages_total") == 4096
    assert value(m, "tandem_time_to_first_token_seconds_count") == 1
    assert value(m, "tandem_time_to_first_token_seconds_sum") == pytest.approx(0.12)
    assert value(m, "tandem_inter_token_latency_seconds_count") == 2
    assert value(m, "tandem_inter_token_latency_seconds_bucket", le="0.01") == 1
    assert value(m, "tandem_inter_token_latency_seconds_bucket", le="0.05") == 2
    assert value(m, "tandem_request_latency_seconds_count") == 1


def test_finish_reasons_are_counted_apart():
    m = RouterMetrics(gpu=False)
    for reason in ("stop", "length", "stop", "cancelled"):
        m.request_started()
        m.request_finished(reason, 1, 1, 0, 0.1)
    assert value(m, "tandem_requests_total", finish_reason="stop") == 2
    assert value(m, "tandem_requests_total", finish_reason="length") == 1
    assert value(m, "tandem_requests_total", finish_reason="cancelled") == 1


def test_impossible_counts_are_refused():
    m = RouterMetrics(gpu=False)
    with pytest.raises(ValueError):
        m.cache_query(query_tokens=10, hit_tokens=11)
    with pytest.raises(ValueError):
        m.spec_decode(draft_tokens=3, accepted_tokens=4)


def test_two_objects_do_not_share_state():
    a, b = RouterMetrics(gpu=False), RouterMetrics(gpu=False)
    a.request_started()
    a.request_finished("stop", 5, 7, 0, 0.5)
    assert value(a, "tandem_prompt_tokens_total") == 5
    assert value(b, "tandem_prompt_tokens_total") == 0
    assert value(b, "tandem_requests_running") == 0


def test_http_endpoint_serves_the_registry():
    m = RouterMetrics(gpu=False)
    m.set_kv_usage(3, 8)
    server = m.serve(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            assert r.status == 200
            text = r.read().decode()
    finally:
        server.shutdown()
    assert "tandem_kv_pages_used 3.0" in text
    assert "tandem_kv_pages_total 8.0" in text
    assert "tandem_time_to_first_token_seconds_bucket" in text


class NoNvml:
    class NVMLError(Exception):
        pass

    def nvmlInit(self):
        raise self.NVMLError("NVML Shared Library Not Found")


class FakeNvml:
    """Two GPUs; our own process uses memory on both, another on GPU 1, and
    GPU 1 cannot report power."""

    def __init__(self):
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"gpu{i}"

    def nvmlDeviceGetPowerUsage(self, handle):
        if handle == "gpu1":
            raise RuntimeError("not supported")
        return 123_500

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        me = SimpleNamespace(pid=os.getpid(), usedGpuMemory=1 << 30)
        if handle == "gpu0":
            return [me]
        return [me, SimpleNamespace(pid=2 ** 22 + 7, usedGpuMemory=None),
                SimpleNamespace(pid=2 ** 22 + 13, usedGpuMemory=2048)]


def test_gpu_series_are_absent_without_nvml():
    m = RouterMetrics(nvml=NoNvml())
    text = generate_latest(m.registry).decode()
    assert "tandem_gpu_" not in text
    generate_latest(m.registry)  # and a second scrape does not retry or fail


def test_gpu_series_are_absent_or_real_on_this_machine():
    text = generate_latest(RouterMetrics().registry).decode()  # real pynvml: never an error
    if "tandem_gpu_power_watts{" in text:
        assert 'tandem_gpu_power_watts{gpu="0"}' in text


def test_gpu_series_from_nvml_at_scrape_time():
    nvml = FakeNvml()
    m = RouterMetrics(nvml=nvml)
    assert nvml.inits == 0  # registering does not touch NVML
    got = samples(m)
    assert nvml.inits == 1
    me = process_name(os.getpid())
    assert got[("tandem_gpu_memory_bytes", (("pid", str(os.getpid())), ("process", me)))] == 2 << 30
    stranger = (("pid", str(2 ** 22 + 13)), ("process", "unknown"))
    assert got[("tandem_gpu_memory_bytes", stranger)] == 2048
    assert got[("tandem_gpu_power_watts", (("gpu", "0"),))] == pytest.approx(123.5)
    assert ("tandem_gpu_power_watts", (("gpu", "1"),)) not in got
    samples(m)
    assert nvml.inits == 1


def test_process_name_prefers_the_python_module():
    me = process_name(os.getpid())
    # pytest runs as `python -m pytest` or as the `pytest` script
    assert me in ("pytest", os.path.basename(sys.argv[0]), os.path.basename(sys.executable))
    assert process_name(2 ** 22 + 11) == "unknown"


def test_gpu_collector_describes_without_collecting():
    names = [f.name for f in GpuCollector(NoNvml()).describe()]
    assert names == ["tandem_gpu_memory_bytes", "tandem_gpu_power_watts"]
