"""The part of a process's GPU memory that lives outside PyTorch's allocator:
the CUDA context. Its largest piece on a big GPU is the local-memory
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
