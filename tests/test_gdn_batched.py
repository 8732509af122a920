"""The batched GDN path (engine/gdn_batched.py: device-indexed state slots,
fla-core on CUDA when installed) against the model's per-sequence reference
loop. On the CPU the batched layout runs with the PyTorch recurrences; on a
CUDA machine with fla-core the same test checks fla's kernels."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the prefill conv kernel, on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import gdn_batched  # noqa: E402
from engine.batch import ForwardBatch, SequenceInput  # noqa: E402
from engine.cache import CacheShape, PagedKVCache  # noqa: E402
from engine.kv import make_format  # noqa: E402
from engine.loader import load_model  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def run_steps(loaded, batched: bool, monkeypatch, prefill_conv_kernel: bool = False):
    monkeypatch.setattr(gdn_batched, "use_batched_path", lambda x: batched)
    # the unfused batched path under test (the fused steps: tests/test_gdn_kernels.py);
    # the prefill conv kernel (gdn_kernels.conv_chunk) reads the batch's indices
    monkeypatch.setenv("TANDEM_FUSED_GDN", "1" if prefill_conv_kernel else "0")
    monkeypatch.setattr(gdn_batched, "use_fused_path", lambda x, batch: False)
    ids = [[(7 * i + 3) % 512 for i in range(40)], [(5 * i + 1) % 512 for i in range(25)],
           [(3 * i + 2) % 512 for i in range(9)]]
    cache = PagedKVCache(loaded.config, CacheShape(24, 8, 4), DEVICE,
                         make_format("bf16", dtype=loaded.dtype))
    tables = [tuple(range(0, 8)), tuple(range(8, 16)), tuple(range(16, 24))]
    # slot 3 holds garbage that a fresh sequence (start 0) must ignore
    cache.recurrent_state(0)[3].fill_(5.0)
    steps = [
        [SequenceInput(tuple(ids[0][:30]), 0, tables[0], 0),
         SequenceInput(tuple(ids[1][:24]), 0, tables[1], 1)],
        # a chunk after a cached prefix, a decode row and a fresh 1-token prompt
        [SequenceInput(tuple(ids[0][30:39]), 30, tables[0], 0),
         SequenceInput((ids[1][24],), 24, tables[1], 1),
         SequenceInput((ids[2][0],), 0, tables[2], 3)],
        [SequenceInput((ids[0][39],), 39, tables[0], 0),
         SequenceInput((ids[1][0],), 25, tables[1], 1),
         SequenceInput((ids[2][1],), 1, tables[2], 3)],
    ]
    out = [loaded.model(ForwardBatch.build(step, 8, DEVICE), cache, all_logits=True)
           for step in steps]
    return torch.cat(out).float(), [s.clone() for s in cache.recurrent]


@pytest.mark.parametrize("prefill_conv_kernel", [False, True], ids=["torch-conv", "conv-kernel"])
def test_batched_gdn_matches_per_sequence_reference(monkeypatch, prefill_conv_kernel):
    loaded = load_model("tiny-qwen3.5", device=DEVICE, dtype=torch.float32, seed=6)
    ref_logits, ref_states = run_steps(loaded, False, monkeypatch)
    logits, states = run_steps(loaded, True, monkeypatch, prefill_conv_kernel)
    # CUDA: fla's kernels and tf32 attention dots; the CPU fallback is the same
    # math in another summation order (the conv kernel's: 1.6e-4 on one
    # 2-core VM, under 1e-4 on another); a wrong window or offset is off by O(0.1)
    tol = dict(rtol=1e-2, atol=1e-2) if DEVICE == "cuda" \
        else dict(rtol=1e-4, atol=5e-4)
    torch.testing.assert_close(logits, ref_logits, **tol)
    for s, r in zip(states, ref_states):
        torch.testing.assert_close(s[[0, 1, 3]], r[[0, 1, 3]], **tol)


def test_the_varlen_index_names_every_chunk_of_every_sequence():
    """batch.VarlenIndex: fla-core's chunk indices, built on the host once per
    forward; an empty sequence has no chunk, a partial last chunk counts."""
    from engine.batch import GDN_CHUNK_ROWS, VarlenIndex

    offsets = [0, 2 * GDN_CHUNK_ROWS + 2, 2 * GDN_CHUNK_ROWS + 2, 3 * GDN_CHUNK_ROWS + 2]
    index = VarlenIndex.build(offsets, "cpu")
    assert index.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [2, 0]]
    assert index.cu_seqlens.tolist() == index.host_cu_seqlens.tolist() == offsets
    assert index.chunk_indices.dtype == index.cu_seqlens.dtype == torch.long
