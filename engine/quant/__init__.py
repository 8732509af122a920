"""Low-bit weights kept low-bit on the device.

Owns the one packed layout every quantized source is repacked into without
re-quantizing (`QuantTensor`: 4-bit or 8-bit codes with a two-level scale and
an optional minimum per group), its PyTorch reference dequantization, the
Triton W4A16/W8A16 matmul kernels (`kernels.py`) with their references, the
modules that replace nn.Linear / nn.Embedding after loading (`linear.py`),
the weight-format recipes (`recipes.py`: which tensor gets which format, how
many bytes that is), random low-bit weights for dummy shapes, and the CUDA
one-row GEMV (`q4_gemv.cu`, launched by `gemv_cuda.py`; `sm90_builds.py`
compiles its builds without a GPU, for CI).

Must not know file formats (GGUF blocks and GPTQ packing are decoded in
engine/weights/), processes, or the KV cache.
"""
from engine.quant.tensor import QuantTensor

__all__ = ["QuantTensor"]
