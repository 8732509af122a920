"""Where a piece of work's time goes: a torch.profiler run summed by kernel
and by kind (weight GEMMs, attention, GDN, norms, copies). The benches print
these tables; the prefill worker logs one line per request with it
(TANDEM_PROFILE_PREFILL=1), since an agent turn's prefill in the service took
~130 ms more than the same step offline and nothing said where.

On CUDA the units are kernels (device time); on the CPU they are aten ops
(their own CPU time, nested ops not counted twice), so wall time minus op
time is Python and waiting on either path."""
from __future__ import annotations

import gc
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

# Substrings of kernel names -> the kind of work they do; first match wins.
KINDS = (
    ("gemm (Triton int4/int8)", ("_gemm_kernel",)),
    ("gemm (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma", "splitkreduce", "aten::mm",
                       "aten::addmm", "aten::linear", "aten::bmm")),
    ("gemv (Triton int4/int8)", ("_gemv_", "_split_k_sum")),
    ("gemv (CUDA int4 DP4A)", ("tandem_q4_gemv",)),
    ("gemv (cuBLAS fp32)", ("gemvnsp", "gemv")),
    ("attention", ("attn", "attention", "flash", "paged", "_combine")),
    ("kv write", ("write_kv", "quantize", "_seal", "_write_kernel", "_k_page_kernel")),
    # quantized pages into a prefill chunk's bf16 workspace
    ("kv read", ("_read_kernel", "_dense_kernel")),
    ("gdn", ("delta", "_recurrence", "_conv", "chunk_")),
    ("fused (ours)", ("_rms", "_norm", "_gdn", "_silu", "_rotary", "_gate")),
    ("copy / index / cat", ("copy", "index", "gather", "scatter", "cat", "memcpy", "fill",
                            "slice", "select", "view", "reshape", "empty")),
    ("reduce", ("reduce", "sum", "max")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "aten::")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "other"


def kernel_times(prof) -> dict[str, list[float]]:
    """{kernel name: [calls, total device us]} of a finished torch.profiler run."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = kernels[event.name]
        entry[0] += 1
        entry[1] += event.device_time
    return kernels


def op_times(prof) -> dict[str, list[float]]:
    """{aten op: [calls, own CPU us]} of a finished CPU profiler run: each
    op's time minus its children's, so nested ops are counted once."""
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU or \
                not event.name.startswith("aten::"):
            continue
        entry = ops[event.name]
        entry[0] += 1
        entry[1] += event.self_cpu_time_total
    return ops


def by_kind(units: dict[str, list[float]]) -> dict[str, list[float]]:
    """{kind: [calls, us]}, largest first."""
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, (calls, us) in units.items():
        kinds[kind_of(name)][0] += calls
        kinds[kind_of(name)][1] += us
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1][1]))


@dataclass
class Profile:
    """One profiled piece of work: wall time and the kernels (or ops) in it.
    Filled from a stopped profiler, `units` is read from it on first use:
    turning its trace into events is most of profiling's cost, so the one
    who profiles can leave that for later (the prefill worker: after its reply)."""

    wall_s: float = 0.0
    _units: dict[str, list[float]] | None = None
    on_cuda: bool = False
    _source: object = field(default=None, repr=False)  # the stopped torch.profiler

    @property
    def units(self) -> dict[str, list[float]]:
        if self._units is None:
            source = self._source
            self._units = {} if source is None else dict(
                kernel_times(source) if self.on_cuda else op_times(source))
            self._source = None
        return self._units

    @property
    def busy_s(self) -> float:
        return sum(us for _, us in self.units.values()) / 1e6

    @property
    def launches(self) -> int:
        return int(sum(calls for calls, _ in self.units.values()))

    def describe(self, kinds: int = 5, top: int = 3) -> str:
        """One log line: wall, busy share, the largest kinds and units."""
        unit = "kernels" if self.on_cuda else "aten ops"
        busy = self.busy_s
        share = 100 * busy / self.wall_s if self.wall_s else 0.0
        if not busy:
            return f"{1e3 * self.wall_s:.0f} ms wall, no {unit} recorded"
        by = by_kind(self.units)
        kind_text = ", ".join(f"{k} {100 * us / 1e6 / busy:.0f}%"
                              for k, (_, us) in list(by.items())[:kinds])
        largest = sorted(self.units.items(), key=lambda kv: -kv[1][1])[:top]
        top_text = ", ".join(f"{name[:48]} x{int(calls)} {us / 1e3:.1f} ms"
                             for name, (calls, us) in largest)
        return (f"{1e3 * self.wall_s:.0f} ms wall, {unit} {1e3 * busy:.0f} ms ({share:.0f}%) "
                f"in {self.launches} launches: {kind_text}; largest: {top_text}")


@contextmanager
def profiled(device: torch.device) -> Iterator[Profile]:
    """Profiles the block; the yielded Profile is filled when it exits (the
    device is synchronized first, so the wall time covers the queued work;
    its units are read from the trace when first asked for)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    result = Profile(on_cuda=on_cuda)
    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    started = time.perf_counter()
    with profile(activities=[activity]) as prof:
        try:
            yield result
        finally:
            if on_cuda:
                torch.cuda.synchronize(device)
            result.wall_s = time.perf_counter() - started
    result._source = prof


class Timeline:
    """The cheap view of one piece of work (a request's prefill): wall time
    per step, each step ending where the caller marks it (the prefill worker:
    after each chunk's sync), the garbage collector's pauses meanwhile (any
    thread's: a collection holds the GIL) and the GPU's SM clock at both
    ends. It costs a few microseconds, so it can watch the turns that
    torch.profiler does not slow: on the H200 (12-03 11:16) 7 of 19 agent
    turns took 60-140 ms more than their neighbours, and the profiled ones
    could not say whether a chunk, a collection or the clock moved."""

    def __init__(self, device: torch.device) -> None:
        self._clock = _sm_clock_reader(device)
        self.marks: list[float] = []
        self.gc_s = 0.0
        self.collections = 0
        self._gc_began = 0.0
        self.clocks_mhz: list[int] = []
        self.ended = 0.0

    def __enter__(self) -> "Timeline":
        gc.callbacks.append(self._on_gc)
        self._read_clock()
        self.marks.append(time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        self.ended = time.perf_counter()
        self._read_clock()
        gc.callbacks.remove(self._on_gc)

    def mark(self) -> None:
        self.marks.append(time.perf_counter())

    def marking(self, step_end: Callable[[], None]) -> Callable[[], None]:
        """`step_end`, then a mark (the prefill worker's between-chunks hook)."""
        def marked() -> None:
            step_end()
            self.mark()
        return marked

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_began
            self.collections += 1

    def _read_clock(self) -> None:
        if self._clock is not None:
            self.clocks_mhz.append(self._clock())

    @property
    def steps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    @property
    def wall_s(self) -> float:
        return self.ended - self.marks[0] if self.marks and self.ended else 0.0

    def describe(self, step_name: str = "chunk") -> str:
        """One log line: wall, the steps and what came after the last, the
        collections, the SM clock."""
        steps = self.steps_s
        after = self.ended - self.marks[-1] if self.ended else 0.0
        parts = " + ".join(f"{1e3 * s:.0f}" for s in steps) or "-"
        text = (f"{1e3 * self.wall_s:.0f} ms wall: {len(steps)} {step_name}s of {parts} ms, "
                f"{1e3 * after:.0f} ms after; gc {1e3 * self.gc_s:.1f} ms in "
                f"{self.collections} collections")
        if len(self.clocks_mhz) == 2:
            text += f"; SM clock {self.clocks_mhz[0]} -> {self.clocks_mhz[1]} MHz"
        return text


def _sm_clock_reader(device: torch.device) -> Callable[[], int] | None:
    """A function that reads the GPU's current SM clock (MHz) through NVML;
    None off CUDA or where NVML does not answer."""
    from engine.cuda_context import nvml_handle

    found = nvml_handle(device)
    if found is None:
        return None
    pynvml, handle = found
    try:
        pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
    except Exception:  # a driver that does not answer
        return None
    return lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
