"""A process's GPU memory: the CUDA context outside PyTorch's allocator, and
a watch on PyTorch's own reserve (ReserveWatch), which the workers log so
that a measured peak can be set against the plan's lines.

The CUDA context. Its largest piece on a big GPU is the local-memory
reservation for thread stacks, stack size x resident threads x SMs (1 KiB x
2,048 x 132 = 264 MiB on an H200), made up front whether or not a kernel
ever uses a stack. Our kernels (Triton, cuBLAS, PyTorch's) do not, so every
GPU process of the service lowers the limit at start-up; the driver raises
it again for a kernel that needs more (cuCtxSetLimit's documented rule), so
this saves memory without risking a failed launch. Measured with NVML on the
H200 (scripts/device_context.py): context 612 MiB at the default, 414 MiB at
256 bytes, 364 MiB at 64 bytes."""
from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

STACK_BYTES = 64
_CU_LIMIT_STACK_SIZE = 0


@functools.lru_cache(maxsize=None)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def trim_stack_reservation(device: torch.device | str, stack_bytes: int = STACK_BYTES) -> bool:
    """Lower the per-thread stack limit of `device`'s context; False (and no
    change) on the CPU or where the driver library cannot be reached."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.zeros(1, device=device)  # the primary context is current from here on
        try:
            rc = _libcuda().cuCtxSetLimit(ctypes.c_int(_CU_LIMIT_STACK_SIZE),
                                          ctypes.c_size_t(stack_bytes))
        except OSError:
            return False
    if rc != 0:
        raise RuntimeError(f"cuCtxSetLimit(CU_LIMIT_STACK_SIZE, {stack_bytes}) failed with "
                           f"CUresult {rc}")
    return True


def stack_limit(device: torch.device | str) -> int | None:
    """The per-thread stack limit of `device`'s context now (bytes): above
    the trimmed STACK_BYTES it names a kernel that raised it, and with it
    the local-memory reservation (limit x resident threads x SMs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    limit = ctypes.c_size_t()
    with torch.cuda.device(device):
        try:
            rc = _libcuda().cuCtxGetLimit(ctypes.byref(limit), ctypes.c_int(_CU_LIMIT_STACK_SIZE))
        except OSError:
            return None
    return limit.value if rc == 0 else None


def nvml_handle(device: torch.device | str):
    """(the pynvml module, NVML's handle of `device`), or None off CUDA or
    where NVML does not answer (no library, a driver that does not answer)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        import pynvml
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None


def process_gpu_bytes(device: torch.device | str) -> int | None:
    """What NVML says this process holds on `device` (context, modules,
    local memory and PyTorch's reserve together); None where NVML cannot say."""
    found = nvml_handle(device)
    if found is None:
        return None
    pynvml, handle = found
    try:
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # a driver that does not answer
        return None
    return next((p.usedGpuMemory for p in processes if p.pid == os.getpid()), None)


MiB = 1 << 20
ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def grow_segments_in_place() -> None:
    """Has PyTorch's allocator grow its segments in place (expandable
    segments) instead of caching one fixed-size segment per request size,
    unless the environment already configures the allocator. Call before the
    process's first CUDA allocation.

    Why: a long prompt's prefill asks for slightly larger buffers every chunk
    (attention over ever more keys), and the caching allocator keeps each
    outgrown segment. On the H100 (12-05) a 260,000-token prompt in 512-token
    chunks left the prefill worker's reserve at 4,118 MiB while it never had
    more than 477 MiB allocated, and the 24 GiB service peaked at 25.9 GiB."""
    os.environ.setdefault(ALLOCATOR_ENV, "expandable_segments:True")


@dataclass
class ReserveWatch:
    """Reports (through `report`) PyTorch's peak reserve on a GPU when it has
    grown by at least `step_bytes` since the last report, or when a kernel
    has raised the context's stack limit: the caching allocator never hands
    memory back by itself, and the driver never lowers the limit, so both
    peaks are what the process costs the plan. Each line also gives NVML's
    figure for the whole process. Off the GPU it reports nothing."""
    device: torch.device
    report: Callable[[str], None]
    step_bytes: int = 64 * MiB
    reported: int = -1
    reported_stack: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.step_bytes <= 0:
            raise ValueError(f"ReserveWatch.step_bytes must be positive, got {self.step_bytes}")

    def check(self, where: str) -> None:
        """Reports the peak, naming `where` it was seen, if it grew enough."""
        if self.device.type != "cuda":
            return
        peak = torch.cuda.max_memory_reserved(self.device)
        stack = stack_limit(self.device) or 0
        if self.reported >= 0 and peak < self.reported + self.step_bytes \
                and stack <= self.reported_stack:
            return
        self.reported, self.reported_stack = peak, stack
        allocated = torch.cuda.max_memory_allocated(self.device)
        self.report(f"PyTorch's reserve peaked at {peak / MiB:.0f} MiB (allocated at most "
                    f"{allocated / MiB:.0f} MiB) by {where}{self._outside_pytorch()}")

    def _outside_pytorch(self) -> str:
        """What the process holds beside the reserve: NVML's total for it and
        the stack limit (a kernel that spills raises it for the whole context)."""
        held, stack = process_gpu_bytes(self.device), stack_limit(self.device)
        parts = ([f"the process holds {held / MiB:.0f} MiB (NVML)"] if held is not None else []) \
            + ([f"stack limit {stack} B"] if stack is not None else [])
        return "; " + ", ".join(parts) if parts else ""

    def release(self, where: str) -> None:
        """Hands the cached blocks back to the driver and starts the peak
        over (reported as `where`): for memory a one-off phase reserved."""
        if self.device.type != "cuda":
            return
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.reported = -1
        self.check(where)
