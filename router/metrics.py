"""Prometheus metrics of the router, and the HTTP endpoint that exposes them.

Owns the metric names, help texts, buckets and labels, and the scrape-time
collector of per-process GPU memory and GPU power (via NVML, where a GPU and
its driver exist; elsewhere those series are absent, never an error).

Must not know about requests, protobuf, gRPC or the engine: the router calls
domain-named methods with plain numbers. Each `RouterMetrics` owns its own
`CollectorRegistry` (no module-global registry), so tests can make several.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

# Seconds. A first token waits for the prefill of the prompt's uncached part;
# a following token is one decode step (milliseconds), a request many of them.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                       0.1, 0.25, 0.5, 1.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class RouterMetrics:
    """The router's metrics on a registry of their own (`self.registry`).

    Call request_started() when a request is admitted and request_finished()
    exactly once when it ends for any reason (including errors and
    cancellations), so tandem_requests_running stays right.
    """

    def __init__(self, gpu: bool = True, nvml=None):
        """gpu: add the NVML collector; nvml: a pynvml-like module (tests)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self._ttft = Histogram("tandem_time_to_first_token_seconds",
                               "Time from request arrival to its first generated token",
                               buckets=TTFT_BUCKETS, registry=r)
        self._ttft_phase = Histogram(
            "tandem_ttft_phase_seconds",
            "Where time to first token goes: tokenize (the prompt), reserve (prefix match, "
            "pages, state slots), prefill (the prefill worker's call, first token included), "
            "cache (handing the prompt's pages to the prefix cache: after the first token "
            "is sent, before decode starts)",
            ["phase"], buckets=TTFT_BUCKETS, registry=r)
        self._inter_token = Histogram("tandem_inter_token_latency_seconds",
                                      "Time between consecutive generated tokens of a request",
                                      buckets=INTER_TOKEN_BUCKETS, registry=r)
        self._latency = Histogram("tandem_request_latency_seconds",
                                  "Time from request arrival to its last token",
                                  buckets=REQUEST_BUCKETS, registry=r)
        self._prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests",
                                      registry=r)
        self._generation_tokens = Counter("tandem_generation_tokens",
                                          "Generated tokens of finished requests", registry=r)
        self._cached_prompt_tokens = Counter(
            "tandem_prompt_tokens_cached",
            "Prompt tokens of finished requests that came from the prefix cache (not prefilled)",
            registry=r)
        self._requests = Counter("tandem_requests", "Finished requests by finish reason",
                                 ["finish_reason"], registry=r)
        self._cache_queries = Counter("tandem_prefix_cache_queries", "Prefix cache lookups",
                                      registry=r)
        self._cache_query_tokens = Counter("tandem_prefix_cache_query_tokens",
                                           "Tokens looked up in the prefix cache", registry=r)
        self._cache_hit_tokens = Counter("tandem_prefix_cache_hit_tokens",
                                         "Looked-up tokens found in the prefix cache", registry=r)
        self._draft_tokens = Counter("tandem_spec_drafted_tokens",
                                     "Speculative decoding: draft tokens verified by the target",
                                     registry=r)
        self._accepted_tokens = Counter("tandem_spec_accepted_tokens",
                                        "Speculative decoding: draft tokens accepted and emitted",
                                        registry=r)
        self._kv_pages_used = Gauge("tandem_kv_pages_used", "KV pages in use (live or cached)",
                                    registry=r)
        self._kv_pages_total = Gauge("tandem_kv_pages_total", "KV pages in the store's pool",
                                     registry=r)
        self._running = Gauge("tandem_requests_running", "Requests admitted and not finished",
                              registry=r)
        self._awaiting_stop = Gauge(
            "tandem_requests_awaiting_worker_stop",
            "Ended requests whose pages stay held until a worker confirms it stopped them",
            registry=r)
        self._worker_requests = Counter("tandem_worker_requests",
                                        "Requests routed to each worker (disaggregated topology)",
                                        ["worker"], registry=r)
        self._transfer_pages = Counter("tandem_kv_transfer_pages",
                                       "KV pages moved from prefill to decode stores", registry=r)
        self._transfer_bytes = Counter("tandem_kv_transfer_bytes",
                                       "Bytes (pages and state slots) moved from prefill to "
                                       "decode stores", registry=r)
        self._transfer_wait = Histogram("tandem_kv_transfer_wait_seconds",
                                        "Time from the end of a prefill until its transfer "
                                        "finished arriving at the decode store",
                                        buckets=INTER_TOKEN_BUCKETS, registry=r)
        if gpu:
            r.register(GpuCollector(nvml))

    def request_started(self) -> None:
        self._running.inc()

    def first_token(self, seconds: float) -> None:
        """Time to first token of one request."""
        self._ttft.observe(seconds)

    def ttft_phase(self, phase: str, seconds: float) -> None:
        """One phase of a request's time to first token (tandem_ttft_phase_seconds)."""
        self._ttft_phase.labels(phase=phase).observe(seconds)

    def token(self, seconds_since_previous: float) -> None:
        """One generated token after the first."""
        self._inter_token.observe(seconds_since_previous)

    def request_finished(self, reason: str, prompt_tokens: int, completion_tokens: int,
                         cached_tokens: int, latency: float) -> None:
        """reason: the finish reason (stop, length, cancelled, error, ...);
        cached_tokens: prompt tokens served from the prefix cache."""
        self._running.dec()
        self._requests.labels(finish_reason=reason).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(completion_tokens)
        self._cached_prompt_tokens.inc(cached_tokens)
        self._latency.observe(latency)

    def cache_query(self, query_tokens: int, hit_tokens: int) -> None:
        """One prefix-cache lookup of query_tokens, of which hit_tokens matched."""
        if hit_tokens > query_tokens:
            raise ValueError(f"hit_tokens {hit_tokens} > query_tokens {query_tokens}")
        self._cache_queries.inc()
        self._cache_query_tokens.inc(query_tokens)
        self._cache_hit_tokens.inc(hit_tokens)

    def spec_decode(self, draft_tokens: int, accepted_tokens: int) -> None:
        """One or more verify steps: draft tokens proposed, of which accepted."""
        if accepted_tokens > draft_tokens:
            raise ValueError(f"accepted_tokens {accepted_tokens} > draft_tokens {draft_tokens}")
        self._draft_tokens.inc(draft_tokens)
        self._accepted_tokens.inc(accepted_tokens)

    def worker_assigned(self, worker: str) -> None:
        """A request was routed to `worker` (e.g. "decode-1")."""
        self._worker_requests.labels(worker=worker).inc()

    def kv_transfer(self, pages: int, num_bytes: int, wait_s: float) -> None:
        """One finished prefill -> decode transfer."""
        self._transfer_pages.inc(pages)
        self._transfer_bytes.inc(num_bytes)
        self._transfer_wait.observe(wait_s)

    def awaiting_worker_stop(self, change: int) -> None:
        """+1 when an ended request's pages stay held for a worker that has not
        confirmed the stop (it may still write them), -1 when they go back."""
        self._awaiting_stop.inc(change)

    def set_kv_usage(self, used: int, total: int) -> None:
        self._kv_pages_used.set(used)
        self._kv_pages_total.set(total)

    def serve(self, port: int, host: str = "127.0.0.1") -> "MetricsServer":
        """Starts the HTTP exposition (any path answers; /metrics by custom)
        in a daemon thread; port 0 picks a free one (see .port)."""
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(httpd, thread)


@dataclass
class MetricsServer:
    """A running exposition server; shutdown() stops it and frees the port."""
    httpd: object
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5.0)


class GpuCollector:
    """Per-process GPU memory and per-GPU power, read from NVML at scrape time.

    NVML is initialised on the first scrape; if that fails (no driver, no GPU,
    no pynvml) it is never tried again and the series are simply absent. A
    query that fails on one device skips that value only.
    """

    def __init__(self, nvml=None):
        self._nvml = nvml
        self._ready: bool | None = None  # None: not tried yet
        self._lock = threading.Lock()

    def describe(self):
        # Names only, so registering does not touch NVML.
        return [_memory_family(), _power_family()]

    def collect(self):
        nvml = self._nvml_or_none()
        if nvml is None:
            return []
        memory, power = _memory_family(), _power_family()
        used_by_pid: dict[int, int] = {}
        for index in range(_call(nvml, "nvmlDeviceGetCount", default=0)):
            handle = _call(nvml, "nvmlDeviceGetHandleByIndex", index)
            if handle is None:
                continue
            milliwatts = _call(nvml, "nvmlDeviceGetPowerUsage", handle)
            if milliwatts is not None:
                power.add_metric([str(index)], milliwatts / 1000.0)
            for proc in _call(nvml, "nvmlDeviceGetComputeRunningProcesses", handle, default=[]):
                used = getattr(proc, "usedGpuMemory", None)
                if isinstance(used, int) and used >= 0:  # None in some containers
                    used_by_pid[proc.pid] = used_by_pid.get(proc.pid, 0) + used
        for pid, used in sorted(used_by_pid.items()):
            memory.add_metric([str(pid), process_name(pid)], used)
        return [memory, power]

    def _nvml_or_none(self):
        with self._lock:
            if self._ready is None:
                self._ready = self._init()
        return self._nvml if self._ready else None

    def _init(self) -> bool:
        try:
            if self._nvml is None:
                import pynvml
                self._nvml = pynvml
            self._nvml.nvmlInit()
            return True
        except Exception:  # ImportError, NVMLError (no driver/library), OSError
            return False


def _memory_family() -> GaugeMetricFamily:
    return GaugeMetricFamily("tandem_gpu_memory_bytes",
                             "GPU memory used by each process (NVML), summed over GPUs",
                             labels=["pid", "process"])


def _power_family() -> GaugeMetricFamily:
    return GaugeMetricFamily("tandem_gpu_power_watts", "GPU power draw (NVML)", labels=["gpu"])


def _call(nvml, function: str, *args, default=None):
    """nvml.function(*args), or default when NVML says no (not supported,
    GPU lost, ...): a scrape must never fail because of one query."""
    try:
        return getattr(nvml, function)(*args)
    except Exception:
        return default


def process_name(pid: int) -> str:
    """A short name for PID: the module of `python -m pkg.server` ("kvstore"),
    else the program's base name; "unknown" when it is not visible to us
    (another PID namespace, or gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "unknown"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1].removesuffix(".server")
    return os.path.basename(argv[0]) if argv else "unknown"
