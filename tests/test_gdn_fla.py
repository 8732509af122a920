"""fla-core's chunked gated delta rule (the GPU prefill path of
engine/gdn_batched.gated_delta_rule_prefill) against the PyTorch chunked
form, at the 27B's GDN head layout (16 key heads, 48 value heads, 128-dim):
ragged sequences packed along T, a fresh one among sequences that resume
from a state. Needs CUDA and fla-core (scripts/device_*.sh with TANDEM_FLA=1)."""
import importlib.util

import pytest
import torch

from engine import gdn_batched

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs CUDA and fla-core")


def _case(dtype, lengths=(130, 100, 70), hk=16, hv=48, dk=128, dv=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")
    q, k = randn(t, hk, dk).to(dtype), randn(t, hk, dk).to(dtype)
    v = randn(t, hv, dv).to(dtype)
    decay = -torch.nn.functional.softplus(randn(t, hv)) * 0.3   # log-space, < 0
    beta = torch.sigmoid(randn(t, hv)).to(dtype)
    states = randn(5, hv, dk, dv) * 0.1
    slots = torch.tensor([4, 0, 2], device="cuda")
    fresh = torch.tensor([False, True, False], device="cuda")
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return q, k, v, decay, beta, states, slots, fresh, offsets


def _relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_prefill_matches_the_pytorch_chunked_form(dtype, monkeypatch):
    q, k, v, decay, beta, states, slots, fresh, offsets = _case(dtype)
    results = {}
    for use_fla in (False, True):
        monkeypatch.setattr(gdn_batched, "fla_available", lambda: use_fla)
        s = states.clone()
        o = gdn_batched.gated_delta_rule_prefill(q, k, v, decay, beta, s, slots, fresh, offsets)
        results[use_fla] = (o, s)
    (o_ref, s_ref), (o_fla, s_fla) = results[False], results[True]
    assert not o_fla.isnan().any()
    assert _relative(o_fla, o_ref) < 1e-2
    assert _relative(s_fla[slots], s_ref[slots]) < 1e-2
    # slots no sequence names are untouched
    torch.testing.assert_close(s_fla[[1, 3]], states[[1, 3]])


def test_the_varlen_index_is_flas_own():
    """The chunk indices a forward builds on the host (batch.VarlenIndex) are
    those fla-core would build on the device, for every chunk size it takes."""
    from fla.ops.utils.index import prepare_chunk_indices

    from engine.batch import GDN_CHUNK_ROWS, VarlenIndex

    offsets = [0, 130, 130, 194, 195, 1000]
    index = VarlenIndex.build(offsets, "cuda")
    theirs = prepare_chunk_indices(index.cu_seqlens, GDN_CHUNK_ROWS)
    assert index.chunk_indices.tolist() == theirs.tolist()
