"""Smoke tests of `tandem bench` on the CPU at tiny settings: every bench
runs end to end and its figures are the ones it claims (bytes and FLOPs
checked against hand counts, cache reuse and memory readings present). One
service serves all three service benches to keep CI short."""
import json

import pytest
import torch

from bench import agent_loop, decode, interference, limits, memory, prefill, wire
from bench.service import Service
from engine.kv import make_format
from engine.loader import load_model


def test_decode_bench_bytes_and_roofline(tmp_path):
    out = tmp_path / "decode.json"
    assert decode.main(["--model", "tiny-llama", "--context", "40", "--batch", "1", "2",
                        "--steps", "4", "--kv-format", "int8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    loaded = load_model("tiny-llama", progress=False)
    c = loaded.config
    assert loaded.model.lm_head is not None  # untied: the embedding table is not read whole
    weights = (sum(p.numel() for p in loaded.model.parameters())
               - loaded.model.model.embed_tokens.weight.numel()) * 4
    kv = len(c.attention_layers) * 2 * c.num_kv_heads * (c.head_dim + 2) * 40  # int8 + fp16 scale
    rows = {r["batch"]: r for r in result["results"]}
    assert rows[1]["bytes_per_step"] == weights + kv
    assert rows[2]["bytes_per_step"] == weights + 2 * kv
    for r in rows.values():
        assert r["tok_s"] > 0 and 0 < r["roofline_pct"] < 100


def test_hybrid_step_bytes_count_gdn_state():
    loaded = load_model("tiny-qwen3.5", progress=False)
    c = loaded.config
    fmt = make_format("rk4", block=16, scale_format="e8m0")
    state = len(c.linear_layers) * (c.linear_num_v_heads * c.linear_k_head_dim
                                    * c.linear_v_head_dim * 4
                                    + c.linear_conv_dim * (c.linear_conv_kernel - 1) * 4)
    base = limits.decode_step_bytes(loaded.model, c, fmt, 1, 0)
    assert base == limits.decode_weight_bytes(loaded.model) + 2 * state
    mtp = sum(p.numel() * 4 for p in loaded.model.mtp.parameters())
    table = loaded.model.model.embed_tokens.weight.numel() * 4
    assert mtp > 0  # loaded, but a plain decode step does not read it
    assert limits.decode_weight_bytes(loaded.model) == sum(
        p.numel() * 4 for p in loaded.model.parameters()) - mtp - table


def test_decode_bench_counts_packed_weights_as_stored(tmp_path):
    """--weights int4: the roofline reads each packed matrix's codes and
    scales (Q4_K repacked: 4-bit codes, an int8 scale and minimum per 32
    weights, fp16 d and dmin per superblock), not only the dense parameters."""
    from engine.quant.linear import QuantLinear

    out = tmp_path / "decode.json"
    assert decode.main(["--model", "tiny-qwen3.5", "--weights", "int4", "--context", "24",
                        "--steps", "4", "--kv-format", "int8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    loaded = load_model("tiny-qwen3.5", weights="int4", progress=False)
    model, c = loaded.model, loaded.config
    packed = [(name, m.quant) for name, m in model.named_modules()
              if isinstance(m, QuantLinear) and not name.startswith("mtp.")]
    assert any(name == "lm_head" for name, _ in packed)
    assert all(q.asymmetric and q.group == 32 for _, q in packed)
    codes_and_scales = sum(q.out_features * q.in_features // 32 * (16 + 1 + 1)
                           + q.out_features * q.in_features // q.superblock * (2 + 2)
                           for _, q in packed)
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if not name.startswith("mtp."))   # the norms, the conv, A_log, dt_bias
    kv = len(c.attention_layers) * 2 * c.num_kv_heads * (c.head_dim + 2) * 24  # int8 + fp16 scale
    state = 2 * limits.gdn_state_bytes(c)
    assert result["bytes_per_step"] == codes_and_scales + dense + kv + state
    assert 0 < result["roofline_pct"] < 100


@pytest.mark.parametrize("kv_format", ["int8", "rk4p"])  # rk4p: staged sink and newest pages
def test_prefill_bench_flops(tmp_path, kv_format):
    out = tmp_path / "prefill.json"
    assert prefill.main(["--model", "tiny-llama", "--tokens", "48", "--chunk", "16",
                         "--kv-format", kv_format, "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"][0]
    loaded = load_model("tiny-llama", progress=False)
    c = loaded.config
    params = (sum(p.numel() for p in loaded.model.parameters())
              - loaded.model.model.embed_tokens.weight.numel())  # untied: a lookup, no FLOPs
    attention = len(c.attention_layers) * 4 * c.num_heads * c.head_dim * (48 * 49 / 2)
    assert r["tflops"] * 1e12 * r["seconds"] == pytest.approx(2 * params * 48 + attention)
    assert r["tok_s"] > 0 and r["mfu_pct"] > 0


@pytest.mark.parametrize("model,kv_format", [("tiny-llama", "int8"), ("tiny-qwen3.5", "rk4p")])
def test_prefill_bench_after_a_cached_prefix(tmp_path, model, kv_format):
    """--cached-tokens: the timed tokens attend to the cached ones too (an agent
    turn), and the FLOPs count those keys; hybrid GDN state and rk4p's staged
    pages carry over from the untimed part."""
    out = tmp_path / "prefill.json"
    assert prefill.main(["--model", model, "--tokens", "24", "--cached-tokens", "40",
                         "--chunk", "16", "--kv-format", kv_format, "--repeats", "1",
                         "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"][0]
    loaded = load_model(model, progress=False)
    assert r["cached"] == 40 and r["tokens"] == 24
    assert r["tflops"] * 1e12 * r["seconds"] == pytest.approx(
        limits.prefill_flops(loaded.model, loaded.config, 24, start=40))
    assert limits.prefill_flops(loaded.model, loaded.config, 24, start=40) > \
        limits.prefill_flops(loaded.model, loaded.config, 24)



def test_prefill_flops_count_packed_weights_like_dense_ones(tmp_path):
    """Packed matrices are buffers, not parameters: an int4 model's prefill
    does the dense model's matmul FLOPs (its MFU is not a hundredth of them),
    and bench.prefill --weights runs the packed model."""
    dense, packed = (load_model("tiny-qwen3.5", weights=w, progress=False) for w in ("auto", "int4"))
    assert any(hasattr(m, "qweight") for m in packed.model.modules())
    assert limits.prefill_flops(packed.model, packed.config, 24) == \
        limits.prefill_flops(dense.model, dense.config, 24)
    out = tmp_path / "prefill.json"
    assert prefill.main(["--model", "tiny-qwen3.5", "--weights", "int4", "--tokens", "24",
                         "--chunk", "16", "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"][0]
    assert r["tflops"] * 1e12 * r["seconds"] == pytest.approx(
        limits.prefill_flops(dense.model, dense.config, 24))

def test_wire_bench_times_one_turns_prompt_traffic(tmp_path):
    """bench.wire at a small prompt: every step ran on messages that carry the
    prompt (the bench checks the match and the job before timing), and the
    total before the first token sums those steps."""
    out = tmp_path / "wire.json"
    assert wire.main(["--tokens", "1000", "--page-size", "16", "--repeats", "2",
                      "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["cached_tokens"] == 992  # every whole page but the one the last token needs
    assert r["match_request_bytes"] >= 4 * 1000
    steps = {(s["process"], s["before_first_token"]) for s in r["results"]}
    assert {("router", True), ("store", True), ("prefill", True), ("store", False)} <= steps
    assert all(s["ms"] > 0 for s in r["results"])
    assert r["before_first_token_ms"] == pytest.approx(
        sum(s["ms"] for s in r["results"] if s["before_first_token"]))


def test_the_agent_loop_summary_reads_the_resending_turns():
    turns = [{"ttft_s": t} for t in (0.5, 0.1, 0.4, 0.2, 0.3, 0.9, 0.35, 0.25, 0.45, 0.15)]
    summary = agent_loop.ttft_summary(turns)
    assert summary == {"median": pytest.approx(0.325), "p90": 0.5, "turns": 10}
    assert agent_loop.ttft_summary([]) is None


def test_service_benches_on_one_service(tmp_path):
    with Service("tiny-llama", "cpu", "int8", max_context_tokens=1024, prefill_chunk=32) as svc:
        loop = agent_loop.run(svc, agent_loop.parser().parse_args(
            ["--turns", "2", "--new-tokens", "40", "--first-turn-tokens", "120",
             "--output-tokens", "4"]))
        busy = interference.run(svc, interference.parser().parse_args(
            ["--prefill-tokens", "200", "--decode-tokens", "24", "--prefill-chunk", "32"]))
        mem = memory.run(svc, memory.parser().parse_args(
            ["--prompt-tokens", "40", "--new-tokens", "4", "--json", str(tmp_path / "m.json")]))
    first, second = loop["turns"]
    assert first["prompt_tokens"] > 100 and second["prompt_tokens"] > first["prompt_tokens"] + 30
    assert second["cached_tokens"] >= 96 and second["reused_ratio"] > 0.5
    assert all(t["ttft_s"] > 0 for t in loop["turns"])
    assert loop["later_ttft_s"] == {"median": second["ttft_s"], "p90": second["ttft_s"],
                                    "turns": 1}
    # the router's phases before the first token account for most of its wait;
    # the prompt's cache insert runs after it, so it is not part of that time
    for t in loop["turns"]:
        assert set(t["phases_s"]) == set(agent_loop.PHASES)
        waited = sum(t["phases_s"][name] for name in agent_loop.BEFORE_FIRST_TOKEN)
        assert 0.5 * t["ttft_s"] < waited <= t["ttft_s"] * 1.01
    result = busy["result"]
    assert result["idle_itl_p50_ms"] > 0 and result["prefill_solo_tok_s"] > 0
    assert mem["cached_tokens"] >= 32 and mem["generated"] == 4
    assert mem["first_request_s"] > 0 and mem["second_request_s"] > 0
    assert {"kvstore", "prefill", "decode", "router"} <= set(mem["peak_bytes"])
    assert json.loads((tmp_path / "m.json").read_text())["total_peak_bytes"] > 0


def test_transformers_floor_builds_the_same_shape_and_times_it(tmp_path):
    """bench.transformers_floor runs transformers' own model of a dummy shape:
    the same parameter count as tandem's model of it (its MTP head aside),
    bf16, and positive prefill and decode rates."""
    from bench import transformers_floor

    model = transformers_floor.build_model("tiny-qwen3.5", torch.device("cpu"))
    ours = load_model("tiny-qwen3.5", progress=False).model
    ours_count = sum(p.numel() for name, p in ours.named_parameters()
                     if not name.startswith("mtp."))
    assert sum(p.numel() for p in model.parameters()) == ours_count
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = tmp_path / "floor.json"
    assert transformers_floor.main(["--shape", "tiny-qwen3.5", "--device", "cpu",
                                    "--prompt-tokens", "24", "40", "--new-tokens", "3",
                                    "--repeats", "1", "--decode-max-prompt", "32",
                                    "--json", str(out)]) == 0
    short, long = json.loads(out.read_text())["results"]
    assert (short["prompt_tokens"], long["prompt_tokens"]) == (24, 40)
    assert short["prefill_tok_s"] > 0 and short["decode_tok_s"] > 0
    assert long["prefill_tok_s"] > 0 and long["decode_ms"] is None  # prefill only


def test_gemv_sweep_files_round_trip_and_its_candidates_are_named(tmp_path):
    """What `bench.quant --sweep --json` stores per shape is what
    TANDEM_GEMV_TUNED reads back; --candidates names each block shape once
    and refuses a name it does not know (before it looks for a GPU)."""
    import json

    from bench.quant import candidate_names, config_fields, main
    from engine.quant.gemv_configs import GemvConfig, tuned_from_sweep

    cfg = GemvConfig(32, 1024, 1, 4, 3, prefetch=True, int8_x=True, stream_k=3)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"sweep": [{"bits": 4, "group": 32, "N": 5120, "K": 6144,
                                           "bucket": 1, "best_config": config_fields(cfg)}]}))
    assert tuned_from_sweep(str(path)) == {(4, 32, 5120, 6144, 1): cfg}
    names = candidate_names()
    assert len(names) == len(set(names)) and "x8-n32-k1024-w4-pf-sk3" in names
    old = tmp_path / "old.json"  # sweeps before stream-K stored eight fields
    old.write_text(json.dumps({"sweep": [{"bits": 4, "group": 32, "N": 5120, "K": 6144,
                                          "bucket": 1, "best_config": config_fields(cfg)[:8]}]}))
    assert tuned_from_sweep(str(old)) == {(4, 32, 5120, 6144, 1):
                                          GemvConfig(32, 1024, 1, 4, 3, prefetch=True,
                                                     int8_x=True)}
    assert main(["--sweep", "--candidates", "x8-n32-k999-w8"]) == 2
    assert main(["--sweep", "--splits", "0"]) == 2


def test_mtp_gap_sorts_drafted_tokens_by_kind():
    """bench.mtp_gap --breakdown: what kind of token a draft was for."""
    from bench.mtp_gap import _position_bucket, token_kind

    assert [token_kind(t) for t in (" the", "ing", ",", ".\n", "\n\n", " 42", "**", " ")] == \
        ["word-start", "continuation", "punct", "newline", "newline", "word-start", "punct",
         "word-start"]
    assert [_position_bucket(i) for i in (0, 3, 4, 15, 16, 47, 48, 95)] == \
        ["answer 0-3"] * 2 + ["answer 4-15"] * 2 + ["answer 16-47"] * 2 + ["answer 48+"] * 2


def test_the_speculative_bench_gives_each_prompts_accepted_length():
    """bench.speculative --per-prompt: one length a prompt, from the engine's
    own counters, and the side's mean (weighted by verify steps) lies
    between the prompts' extremes."""
    from bench.speculative import CHAT, CODE, PROMPT_SETS, tokens_per_second

    rows = tokens_per_second(None, "cpu", ["mtp"], [3], 12, per_prompt=True, prompt_set="six")
    assert [r["prompts"] for r in rows] == ["chat", "code"]
    for r in rows:
        assert len(r["per_prompt"]) == r["prompt_count"] == len(CHAT if r["prompts"] == "chat"
                                                                 else CODE)
        assert all(1.0 <= a <= 4.0 for a in r["per_prompt"])
        assert min(r["per_prompt"]) - 1e-3 <= r["mean_accepted_length"] <= \
            max(r["per_prompt"]) + 1e-3
        assert len(set(r["per_prompt"])) > 1   # the prompts differ
    # the set of record (the default) holds the six a side first, then the 30 / 18 added
    chat, code = PROMPT_SETS["record"]
    assert (len(chat), len(code)) == (36, 24) and chat[:6] == CHAT and code[:6] == CODE
    assert len(set(chat)) == 36 and len(set(code)) == 24


def test_the_critical_path_charges_each_kernel_its_advance_of_the_steps_end():
    from bench.profile_step import critical_path, short_name

    assert short_name("void tandem::fused_kernel<int, 4>(float*, int)") == "fused_kernel"
    # a norm, a GEMV placed early (PDL) that ends 7 us later, a kernel hidden
    # inside it, then a hop of 3 us to a last kernel of 2 us
    spans = [("norm", 0.0, 2.0), ("gemv", 1.0, 9.0), ("copy", 3.0, 4.0), ("norm", 12.0, 14.0)]
    table = critical_path(spans)
    assert table["(start) -> norm"] == [1, 2.0, 0.0]
    assert table["norm -> gemv"] == [1, 7.0, 1.0]
    assert table["gemv -> copy"] == [1, 0.0, 6.0]       # ended inside the GEMV: no advance
    assert table["copy -> norm"] == [1, 5.0, 0.0]       # measured from the GEMV's end, not the copy's
    assert sum(adv for _, adv, _ in table.values()) == 14.0   # the span, first start to last end


def test_back_to_back_steps_time_the_engines_decode_batch():
    """bench.quant's GPU-only step on the CPU: it runs the engine's decode
    forward on a batch of one sequence and gives a positive time."""
    from bench.quant import back_to_back_seconds
    from engine.llm import EngineConfig, OfflineEngine

    engine = OfflineEngine(load_model("tiny-qwen3.5", progress=False),
                           EngineConfig(max_batch=1, max_context=256))
    calls = []
    real = engine.decode_forward
    engine.decode_forward = lambda batch: calls.append(batch.positions.tolist()) or real(batch)
    assert back_to_back_seconds(engine, position=40, replays=3) > 0
    assert calls == [[40]] * 4   # one warm-up, then the timed replays
