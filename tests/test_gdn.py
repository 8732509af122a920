"""The two forms of the gated delta rule agree, and both match transformers'
reference implementation (an oracle we did not write)."""
import pytest
import torch

from engine.gdn import causal_conv1d, chunked_gated_delta_rule, recurrent_gated_delta_rule


def _inputs(batch, steps, k_heads, v_heads, dim, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, steps, k_heads, dim, generator=g)
    k = torch.randn(batch, steps, k_heads, dim, generator=g)
    v = torch.randn(batch, steps, v_heads, dim, generator=g)
    decay = -torch.rand(batch, steps, v_heads, generator=g) * 2
    beta = torch.rand(batch, steps, v_heads, generator=g)
    state = torch.randn(batch, v_heads, dim, dim, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("steps,chunk", [(1, 64), (7, 4), (64, 64), (100, 32), (130, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrent(steps, chunk, with_state):
    q, k, v, g, beta, state = _inputs(2, steps, 2, 4, 16, seed=steps)
    init = state if with_state else None
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    o_chk, s_chk = chunked_gated_delta_rule(q, k, v, g, beta, init, chunk_size=chunk)
    torch.testing.assert_close(o_chk, o_rec, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_chk, s_rec, rtol=1e-4, atol=1e-4)


def test_prefill_then_decode_equals_one_pass():
    """Chunked prefill of a prefix, then recurrent steps from its final state,
    equals one recurrent pass over everything: the state slot carries it all."""
    q, k, v, g, beta, _ = _inputs(1, 40, 2, 2, 8, seed=3)
    o_all, s_all = recurrent_gated_delta_rule(q, k, v, g, beta)
    o_pre, s = chunked_gated_delta_rule(q[:, :30], k[:, :30], v[:, :30], g[:, :30], beta[:, :30],
                                        chunk_size=16)
    outs = [o_pre]
    for t in range(30, 40):
        o_t, s = recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                            g[:, t:t + 1], beta[:, t:t + 1], s)
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, dim=1), o_all, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_all, rtol=1e-4, atol=1e-4)


def test_all_states_end_in_final_state():
    q, k, v, g, beta, state = _inputs(1, 5, 1, 2, 8, seed=5)
    _, final, every = recurrent_gated_delta_rule(q, k, v, g, beta, state, output_all_states=True)
    assert every.shape == (1, 5, 2, 8, 8)
    torch.testing.assert_close(every[:, -1], final)


def test_matches_transformers_reference():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    # equal q/k and v heads: older transformers references do not repeat k heads here
    q, k, v, g, beta, state = _inputs(2, 37, 4, 4, 16, seed=11)
    o, s = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    o_ref, s_ref = ref.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)


def test_causal_conv_window_carries_across_calls():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    y_all, w_all = causal_conv1d(x, torch.zeros(6, 3), weight)
    y1, w1 = causal_conv1d(x[:5], torch.zeros(6, 3), weight)
    y2, w2 = causal_conv1d(x[5:], w1, weight)
    torch.testing.assert_close(torch.cat([y1, y2]), y_all)
    torch.testing.assert_close(w2, w_all)
    torch.testing.assert_close(w_all, x[-3:].t())
