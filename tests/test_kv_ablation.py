"""bench/kv_ablation.py: its fake quantizers are the real ones, and the scheme
pieces (channel groups, pre-RoPE, open page) do what they claim."""
import pytest
import torch

from bench import kv_ablation as ab
from bench import kv_quality as kq
from engine.config import ModelConfig, shape_hf_config
from engine.kv import make_format
from engine.rotary import Rotary

needs_text = pytest.mark.skipif(not kq.DEFAULT_TEXT.is_file(),
                                reason=f"{kq.DEFAULT_TEXT} is absent")


@needs_text
def test_fake_rk4_scores_like_the_real_rk4_format():
    from engine.loader import load_model

    loaded = load_model(None, device="cpu", progress=False)
    tokens = kq.text_tokens(loaded.tokenizer, kq.DEFAULT_TEXT, 128)
    formats = {"real": make_format("rk4"), "fake": ab.FakeQuantKV(ab.VARIANTS["rk4"])}
    _, rows = kq.evaluate_context(loaded, tokens, formats, 64, 48)
    assert rows["real"]["mean_kl"] > 1e-4  # quantization is visible at all
    assert rows["fake"]["mean_kl"] == pytest.approx(rows["real"]["mean_kl"], rel=1e-3)
    assert rows["fake"]["top1_agreement_pct"] == rows["real"]["top1_agreement_pct"]


def test_channel_groups_error_is_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(32, 2, 8) * torch.linspace(0.1, 10, 8) + torch.linspace(-5, 5, 8)
    y = ab.channel_groups(x, group=16)
    g = x.reshape(2, 16, 2, 8)
    step = (g.amax(1) - g.amin(1)) / 15
    err = (y - x).abs().reshape(2, 16, 2, 8).amax(1)
    assert (err <= step / 2 * 1.01 + 1e-3).all()
    with pytest.raises(ValueError, match="whole groups"):
        ab.channel_groups(x[:20], group=16)


def test_pre_rope_and_open_page_plumbing():
    rotary = Rotary(ModelConfig.from_hf(shape_hf_config("tiny-llama")))
    exact = ab.Variant(lambda x: x, None, 16, 16, pre_rope=True, open_page=4)
    zeroing = ab.Variant(torch.zeros_like, torch.zeros_like, 0, 0, open_page=4)
    k = torch.randn(10, 2, 32)
    for variant, expect_closed in ((exact, k), (zeroing, torch.zeros_like(k))):
        fmt = ab.FakeQuantKV(variant, rotary)
        buffers = fmt.allocate(4, 4, 2, 32, "cpu")
        fmt.write(buffers, torch.arange(10), k, k)
        got_k, got_v = fmt.read(buffers, torch.arange(4), 10, torch.float32)
        # tokens 8, 9 share the open page: read exact; pages 0, 1 read as stored
        torch.testing.assert_close(got_k[8:], k[8:])
        torch.testing.assert_close(got_k[:8], expect_closed[:8], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rotary"):
        ab.FakeQuantKV(exact)


def test_e8m0_channel_groups_and_codebooks():
    torch.manual_seed(1)
    x = torch.randn(32, 2, 64) * torch.linspace(0.1, 10, 64) + torch.linspace(-5, 5, 64)
    y = ab.channel_groups(x, group=32, step_format="e8m0")
    span = (x.amax(0) - x.amin(0)) / 15
    step = torch.exp2(torch.ceil(torch.log2(span)))
    assert ((y - x).abs() <= step / 2 * 1.01 + 1e-2).all()
    # a power-of-two step is coarser than the exact one: more error than fp16 steps
    err_fp16 = (ab.channel_groups(x, group=32) - x).square().mean()
    assert (y - x).square().mean() > err_fp16
    # rk4p's e5m3 step sits between: at most 1/8 coarser than the fp16 step
    err_e5m3 = (ab.channel_groups(x, group=32, step_format="e5m3") - x).square().mean()
    assert err_fp16 <= err_e5m3 < (y - x).square().mean()
    assert err_e5m3 < err_fp16 * 1.125 ** 2
    v = torch.randn(256, 2, 64)
    err = {name: (q(v) - v).square().mean() for name, q in
           (("rk4", ab._V64), ("lloyd", ab._V64_LLOYD), ("int4", ab._V64_INT4))}
    assert err["lloyd"] < err["rk4"] and err["int4"] < err["rk4"]


def test_open_pages_and_sinks_read_exact():
    zeroing = ab.Variant(torch.zeros_like, torch.zeros_like, 0, 0, open_page=4, open_pages=2,
                         sinks=2)
    fmt = ab.FakeQuantKV(zeroing)
    buffers = fmt.allocate(4, 4, 1, 8, "cpu")
    k = torch.randn(14, 1, 8)
    fmt.write(buffers, torch.arange(14), k, k)
    got, _ = fmt.read(buffers, torch.arange(4), 14, torch.float32)
    torch.testing.assert_close(got[8:], k[8:])  # pages 2 and 3: the two newest
    torch.testing.assert_close(got[:2], k[:2])  # sinks
    assert (got[2:8] == 0).all()
