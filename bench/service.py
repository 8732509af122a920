"""A `tandem serve` under test for the service benchmarks: start it as a
child process on free ports, stream requests with per-chunk timestamps, and
read what its processes use (NVML on a GPU, peak RSS from /proc on the CPU).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from engine.chunking import parse_prefill_chunk
from tandem.ports import free_port


@dataclass
class StreamResult:
    """One Generate call as the client saw it."""

    started: float
    stamps: list[float] = field(default_factory=list)  # arrival of each chunk
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.stamps[0] - self.started

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class Service:
    """`with Service(model=..., device=...) as svc:` starts and stops tandem serve
    (prefill_chunk 0: its --prefill-chunk auto)."""

    def __init__(self, model: str | None, device: str, kv_format: str = "int8",
                 max_context_tokens: int = 8192, prefill_chunk: int = 0,
                 gpu_memory_budget: str | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.max_context_tokens = max_context_tokens
        self.metrics_port = free_port()
        self.cmd = [sys.executable, "-m", "tandem.cli", "serve", "--device", device,
                    "--kv-format", kv_format, "--grpc-port", str(self.port),
                    "--metrics-port", str(self.metrics_port), "--http-port", "0",
                    "--max-context-tokens", str(max_context_tokens),
                    "--prefill-chunk", str(prefill_chunk or "auto"), "--live-slots", "4",
                    "--snapshot-slots", "32", "--max-batch", "4",
                    "--socket-dir", tempfile.mkdtemp(prefix="tandem-bench-"), *extra]
        if model:
            self.cmd += ["--model", model]
        if gpu_memory_budget:
            self.cmd += ["--gpu-memory-budget", gpu_memory_budget]
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> "Service":
        import grpc

        from tandem.v1 import generation_pb2_grpc as pb_grpc

        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread():
            # a time limit's SIGTERM must still stop the service's processes
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.wait()
            raise RuntimeError(f"tandem serve did not start (exit {self.proc.returncode})")
        self.startup_s = time.perf_counter() - t0
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.channel.close()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)

    def phase_seconds(self) -> dict[str, float]:
        """The router's tandem_ttft_phase_seconds sums by phase, so far (diff two
        readings for one request's phases)."""
        import re
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as reply:
            text = reply.read().decode()
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^tandem_ttft_phase_seconds_sum\{phase="(\w+)"\} (\S+)$', text, re.M)}

    def pids(self) -> dict[int, str]:
        """The serve process and its children: pid -> process name."""
        root = self.proc.pid
        found = {root: "serve"}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = open(f"/proc/{entry}/stat").read()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid == root:
                    cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
                    name = next((c.decode().split(".")[0] for c in cmd
                                 if c.endswith(b".server")), "child")
                    found[int(entry)] = name
            except (OSError, IndexError, ValueError):
                continue
        return found

    def generate(self, *, token_ids=None, messages=None, max_new_tokens=16,
                 into: StreamResult | None = None) -> StreamResult:
        """Streams one request; `into` lets another thread watch it progress."""
        from tandem.v1 import generation_pb2 as pb

        kwargs = dict(max_new_tokens=max_new_tokens, ignore_eos=True,
                      sampling=pb.SamplingParameters(temperature=0.0))
        if token_ids is not None:
            kwargs["token_ids"] = pb.TokenIds(ids=token_ids)
        else:
            kwargs["chat"] = pb.Chat(messages=[pb.ChatMessage(role=r, content=c)
                                               for r, c in messages])
        result = into or StreamResult(started=0.0)
        result.started = time.perf_counter()
        for r in self.stub.Generate(pb.GenerateRequest(**kwargs), timeout=1800):
            if r.HasField("chunk"):
                result.stamps.append(time.perf_counter())
                result.token_ids.extend(r.chunk.token_ids)
                result.text += r.chunk.text
            else:
                result.prompt_tokens = r.complete.usage.prompt_tokens
                result.cached_tokens = r.complete.usage.cached_tokens
        return result


class MemorySampler:
    """Samples the service's memory every `period` s in a thread: NVML per
    process and device total on a GPU, else each process's peak RSS (VmHWM)."""

    def __init__(self, service: Service, period: float = 0.05) -> None:
        self.service, self.period = service, period
        self.peak: dict[str, int] = {}
        self.total_peak = 0
        self.energy_mj_start = self.energy_mj_end = None
        self._stop = threading.Event()
        self._nvml = _nvml_handle()

    def __enter__(self) -> "MemorySampler":
        self.energy_mj_start = _energy_mj(self._nvml)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join()
        self.sample()
        self.energy_mj_end = _energy_mj(self._nvml)

    @property
    def source(self) -> str:
        return "NVML" if self._nvml is not None else "peak RSS (/proc VmHWM)"

    def energy_j(self) -> float | None:
        if self.energy_mj_start is None or self.energy_mj_end is None:
            return None
        return (self.energy_mj_end - self.energy_mj_start) / 1000.0

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def sample(self) -> None:
        names = self.service.pids()
        if self._nvml is not None:
            import pynvml
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml):
                name = names.get(p.pid, f"pid {p.pid}")
                self.peak[name] = max(self.peak.get(name, 0), p.usedGpuMemory or 0)
            used = pynvml.nvmlDeviceGetMemoryInfo(self._nvml).used
            self.total_peak = max(self.total_peak, used)
            return
        total = 0
        for pid, name in names.items():
            try:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("VmHWM:"):
                        kib = int(line.split()[1])
                        self.peak[name] = max(self.peak.get(name, 0), kib * 1024)
                        total += kib * 1024
            except OSError:
                continue
        self.total_peak = max(self.total_peak, total)


def _nvml_handle():
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:
        return None


def _energy_mj(handle) -> float | None:
    if handle is None:
        return None
    try:
        import pynvml
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except Exception:
        return None


def add_service_arguments(p, max_context_tokens: int) -> None:
    """The flags of every bench that runs against its own `tandem serve`."""
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-format", default="int8")
    p.add_argument("--max-context-tokens", type=int, default=max_context_tokens)
    p.add_argument("--prefill-chunk", type=parse_prefill_chunk, default="auto",
                   help="auto (the service's default) or tokens per prefill forward")
    p.add_argument("--gpu-memory-budget", default=None)
    p.add_argument("--weights", default=None, help="tandem serve's --weights (e.g. int4)")
    p.add_argument("--speculative", default=None, help="tandem serve's --speculative")
    p.add_argument("--draft-tokens", type=int, default=None)
    p.add_argument("--serve-args", default="",
                   help="more tandem serve flags, appended last so they win "
                        "(e.g. '--live-slots 1 --snapshot-slots 4')")
    p.add_argument("--json", default=None)


def run_against_service(args, run) -> int:
    """Start the service the flags describe, call run(service, args), stop it."""
    extra = []
    for flag, value in (("--weights", args.weights), ("--speculative", args.speculative),
                        ("--draft-tokens", args.draft_tokens)):
        if value is not None:
            extra += [flag, str(value)]
    extra += shlex.split(args.serve_args)
    with Service(args.model, args.device, args.kv_format, args.max_context_tokens,
                 args.prefill_chunk, args.gpu_memory_budget, extra=tuple(extra)) as svc:
        run(svc, args)
    return 0
