"""One 27B GEMV shape run many times in one variant, for Nsight Compute
(device_next67.sh fix): arrays (the register pipeline), copiesC (each
thread's copies of C tiles).

    python scripts/sessions/gemv_variant.py gate_up copies3
"""
import sys

import torch

from bench.quant import _copies, model_shapes
from engine.quant.gemv_cuda import card_name, gemv_cuda, picked_plan
from dataclasses import replace

name, variant = sys.argv[1], sys.argv[2]
device = torch.device("cuda")
fmt, n, k = next((f, n, k) for m, f, n, k, _ in model_shapes() if m == name and f.name == "Q4_K")
weights = _copies(fmt, n, k, device)
copies = int(variant.rsplit("copies", 1)[1]) if "copies" in variant else 0
plan = replace(picked_plan(n, k, card_name(0)), stages=0, copies=copies)
x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
for i in range(40):
    gemv_cuda(x, weights[i % len(weights)], out=out, plan=plan, pdl=True)
torch.cuda.synchronize()
print(name, variant, plan.spec())
