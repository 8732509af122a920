"""How much GPU memory one tandem process holds before it allocates anything
(CUDA context, cuBLAS workspace, Triton modules): the plan's per-process line.
Run on the device: `python scripts/device_context.py` (prints NVML's figure for
this process after each stage)."""
import os

import pynvml
import torch


def used_by_me(handle) -> int:
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.pid == os.getpid():
            return p.usedGpuMemory or 0
    return 0


def main() -> None:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    print(f"context: {used_by_me(handle) / 2**20:.0f} MiB")
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
