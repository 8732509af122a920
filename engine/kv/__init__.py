"""KV page formats: how one layer's pages encode K and V (bf16, int8, rk4,
rk4p), with PyTorch references and the Triton kernels checked against them,
and the open-page rules of formats that quantize whole pages (open_pages.py).

Compute only: which page belongs to whom is the kvstore's business."""
from engine.kv.formats import KVFormat, make_format

__all__ = ["KVFormat", "make_format"]
