"""Shared compute core: what the prefill and decode workers both run.

Owns model configs, weight loading (GGUF, HF safetensors, dummy shapes),
tokenizers and chat templates, the model forward over the paged KV interface,
sampling, speculative decoding, and the GPU fast path: Triton kernels with
their PyTorch references, CUDA graphs, dependent launches (pdl.py).

Must not know about processes, gRPC, protobuf, the radix tree or scheduling:
it computes one forward over a batch it is handed, on pages it is told to use.
"""
