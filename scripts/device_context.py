"""How much GPU memory one tandem process holds before it allocates anything
(CUDA context, cuBLAS workspace, Triton modules): the plan's per-process line,
and what the per-thread stack reservation adds to it.

Run on the device: `python scripts/device_context.py` (prints NVML's figure
for this process after each stage). `--stack BYTES` first lowers the
context's per-thread stack limit (cuCtxSetLimit): the driver reserves stack x
resident threads x SMs of local memory up front, ~270 MiB on an H200 at the
1 KiB default, and grows it again for a kernel that needs more."""
import argparse
import ctypes
import os

import pynvml
import torch

CU_LIMIT_STACK_SIZE = 0x00


def used_by_me(handle) -> int:
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.pid == os.getpid():
            return p.usedGpuMemory or 0
    return 0


def set_stack_limit(stack: int) -> None:
    libcuda = ctypes.CDLL("libcuda.so.1")
    rc = libcuda.cuCtxSetLimit(ctypes.c_int(CU_LIMIT_STACK_SIZE), ctypes.c_size_t(stack))
    if rc != 0:
        raise RuntimeError(f"cuCtxSetLimit(stack, {stack}) returned CUresult {rc}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stack", type=int, default=None)
    args = p.parse_args()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    print(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(unset)')}")
    print(f"context: {used_by_me(handle) / 2**20:.0f} MiB")
    if args.stack is not None:
        set_stack_limit(args.stack)
        torch.cuda.synchronize()
        print(f"after stack limit {args.stack} B: {used_by_me(handle) / 2**20:.0f} MiB")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    print(f"+ cuBLAS bf16 matmul (64 MiB of operands): {used_by_me(handle) / 2**20:.0f} MiB, "
          f"torch reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    from engine.kv import make_format
    fmt = make_format("int8", use_triton=True)
    bufs = fmt.allocate(8, 16, 4, 256, torch.device("cuda"))
    slots = torch.arange(16, device="cuda")
    k = torch.randn(16, 4, 256, device="cuda", dtype=torch.bfloat16)
    fmt.write(bufs, slots, k, k)
    torch.cuda.synchronize()
    print(f"+ a Triton kernel: {used_by_me(handle) / 2**20:.0f} MiB, "
          f"torch reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
