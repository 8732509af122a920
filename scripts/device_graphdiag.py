"""Which decode step is wrong when a CUDA-graph replay disagrees with the
eager step (tests/test_cuda_graphs.py on the H200, 2026-12-01): the same six
decode steps of tests/test_cuda_graphs.py::_decode_logits, per dtype, with
graphs on/off and the fused kernels on/off, against the CPU reference path.
Prints each variant's max |diff| per step to the CPU logits."""
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402

from engine.loader import load_model  # noqa: E402
import test_cuda_graphs as T  # noqa: E402


def run(device, dtype, graphs, fused):
    os.environ["TANDEM_FUSED_GDN"] = os.environ["TANDEM_FUSED_NORMS"] = "1" if fused else "0"
    loaded = load_model("tiny-qwen3.5", device=device, dtype=dtype, seed=3)
    if device == "cpu":
        return T._decode_logits(loaded, "int8", graphs=False, device="cpu")
    return T._decode_logits(loaded, "int8", graphs=graphs).cpu()


for dtype in (torch.float32, torch.bfloat16):
    reference = run("cpu", dtype, False, False)
    for graphs in (False, True):
        for fused in (True, False):
            try:
                got = run("cuda", dtype, graphs, fused)
                diff = (got - reference).abs().reshape(-1, got.shape[-1]).amax(-1)
                print(f"{dtype} graphs={graphs} fused={fused}: max diff per row "
                      + " ".join(f"{d:.3f}" for d in diff.tolist()), flush=True)
            except Exception as e:
                print(f"{dtype} graphs={graphs} fused={fused}: failed {type(e).__name__}: "
                      f"{str(e)[:200]}", flush=True)
