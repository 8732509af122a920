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
