"""The store's capacity plan (Qwen3.5-27B shape, plan only: no weights are
allocated) and its arenas' layouts and shared memory files, in one process."""
import os

import pytest
import torch

from engine.cache import CacheShape
from engine.config import ModelConfig, shape_hf_config
from engine.errors import TandemError
from engine.loader import load_model, plan_inputs
from kvstore.arena import ALIGNMENT, Arena, ArenaMapError, Layout, SHM_DIR
from kvstore.memory import (KVFormatSpec, cache_on_arenas, config_from_json, config_to_json,
                            create_arenas, kv_layout, model_on_arena, open_arenas)
from kvstore.plan import GiB, MiB, CapacityPlan, OverBudgetError, parse_bytes, weight_bytes_of


def _qwen27b():
    return ModelConfig.from_hf(shape_hf_config("qwen3.5-27b"))


def _dense_config():
    return ModelConfig.from_hf(shape_hf_config("tiny-llama"))


def _plan(config, weight_bytes, budget="24GiB", **kw):
    args = dict(config=config, kv_format=KVFormatSpec("rk4"), page_size=16,
                max_context_tokens=262_144, live_slots=8, snapshot_slots=32,
                gpu_memory_budget=parse_bytes(budget), weight_bytes=weight_bytes)
    args.update(kw)
    return CapacityPlan(**args)


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * GiB
    assert parse_bytes("24G") == 24 * GiB
    assert parse_bytes("20GB") == 20 * 10**9
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("1.5GiB") == 3 * GiB // 2
    assert parse_bytes("4096") == 4096
    for bad in ("", "GiB", "24 parsecs", "-1GiB"):
        with pytest.raises(ValueError, match="cannot read"):
            parse_bytes(bad)


def test_qwen27b_rk4_kv_for_262k_tokens_fits_in_4_5_gib():
    plan = _plan(_qwen27b(), weight_bytes=13 * 10**9, budget="64GiB")
    kv = plan.line("kv pages").bytes
    assert kv <= 4.5 * GiB
    # 16 attention layers x 4 KV heads x (128 code bytes + 8 fp16 scales) x K and V
    assert kv == 262_144 * 16 * 2 * 4 * (128 + 16)
    plan.check()


def test_qwen27b_bf16_weights_do_not_fit_24gib():
    config = _qwen27b()
    weight_bytes = weight_bytes_of(config, torch.bfloat16)
    assert 50e9 < weight_bytes < 58e9  # ~27B parameters (and the MTP head) in bf16
    plan = _plan(config, weight_bytes)
    with pytest.raises(OverBudgetError) as e:
        plan.check()
    message = str(e.value)
    assert isinstance(e.value, TandemError)
    assert "over budget: weights" in message and "does not fit" in message
    assert "weights alone do not fit" in message
    for line in ("weights", "kv pages", "gdn live slots", "gdn snapshot slots",
                 "activation reserve", "allocator slack", "total", "budget"):
        assert line in message  # the whole plan is printed
    assert "24.00 GiB" in message


def test_the_first_line_past_the_budget_is_named_with_what_to_lower():
    plan = _plan(_qwen27b(), weight_bytes=14 * 10**9, snapshot_slots=64)
    with pytest.raises(OverBudgetError, match=r"gdn snapshot slots .* does not fit.*"
                                              r"lower --snapshot-slots \(now 64\)"):
        plan.check()


def test_the_plan_names_the_largest_prefill_chunk_its_budget_fits():
    """Larger chunks prefill 4-bit weights faster: a plan that fits says
    when a larger chunk fits too, and one over budget says which smaller
    chunk would fit, each checked by planning that chunk."""
    from kvstore.plan import PREFILL_CHUNK_CHOICES

    def plan(chunk, budget="24GiB"):
        return _plan(_qwen27b(), weight_bytes=15 * GiB, live_slots=1, snapshot_slots=4,
                     prefill_chunk_tokens=chunk, budget=budget, cuda_processes=3,
                     paged_attention_kernel=True)

    small = plan(512)
    best = small.largest_fitting_chunk()
    assert best in PREFILL_CHUNK_CHOICES and best > 512
    assert plan(best).spare_bytes >= 0
    larger = [c for c in PREFILL_CHUNK_CHOICES if c > best]
    assert larger and all(plan(c).spare_bytes < 0 for c in larger)
    small.check()
    assert f"also fits --prefill-chunk {best} (now 512)" in small.table()
    assert "--prefill-chunk" not in plan(best).table().split("spare")[-1]  # nothing larger fits
    too_large = plan(larger[0])
    with pytest.raises(OverBudgetError, match=rf"--prefill-chunk {best} fits this budget"):
        too_large.check()
    unlimited = _plan(_qwen27b(), weight_bytes=15 * GiB, gpu_memory_budget=None)
    assert unlimited.largest_fitting_chunk() is None and "--prefill-chunk" not in unlimited.table()
    # over budget whatever the chunk (the weights alone): no chunk to name
    with pytest.raises(OverBudgetError) as e:
        plan(512, budget="8GiB").check()
    assert "fits this budget" not in str(e.value)


def test_what_to_lower_names_flags_of_tandem_serve():
    """The over-budget advice reaches users through `tandem serve` (the store
    refuses to start) and `tandem plan`: it names serve's flags, not the
    internal store's (--prefill-chunk-tokens)."""
    import argparse
    import re

    from tandem.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    known = {s for action in commands.choices["serve"]._actions for s in action.option_strings}
    plan = _plan(_qwen27b(), weight_bytes=14 * 10**9)
    named = {flag for line in plan.lines for flag in re.findall(r"--[a-z][a-z-]*", line.lower)}
    assert "--prefill-chunk" in named
    assert named <= known, named - known


def test_plan_validates_on_creation():
    config = _qwen27b()
    with pytest.raises(ValueError, match="page_size"):
        _plan(config, 1, page_size=0)
    with pytest.raises(ValueError, match="live_slots"):
        _plan(config, 1, live_slots=0)  # a hybrid model needs a live slot
    with pytest.raises(ValueError, match="unknown KV format"):
        _plan(config, 1, kv_format=KVFormatSpec("fp3"))
    with pytest.raises(ValueError, match="block"):
        _plan(config, 1, kv_format=KVFormatSpec("rk4", {"block": 48}))
    with pytest.raises(ValueError, match="staging pages: live_slots"):
        _plan(_dense_config(), 1, kv_format=KVFormatSpec("rk4p"), page_size=32, live_slots=0)


def test_rk4p_plans_its_staging_pages():
    """Each live sequence holds 1 sink + 3 newest + 1 spill bf16 pages, and the
    cache may keep one sink page per live sequence more: 8 x 6 = 48 pages of
    32 tokens x 4 KV heads x 256 x (K, V) x 2 bytes x 16 layers = 2 MiB each."""
    plan = _plan(_qwen27b(), 1, kv_format=KVFormatSpec("rk4p"), page_size=32)
    assert plan.num_staging_pages == 48 and plan.cache_shape.staging_pages == 48
    assert plan.line("kv staging pages").bytes == 48 * 2 * MiB
    assert "8 live x (5 + 1 cached sink)" in plan.line("kv staging pages").detail
    # 4.5 bits per element: 262,144 tokens x 4 x 256 x 2 x 16 layers x 4.5 / 8
    assert plan.line("kv pages").bytes == pytest.approx(262_144 * 4 * 256 * 2 * 16 * 4.5 / 8,
                                                        rel=1e-3)
    assert _plan(_qwen27b(), 1).line("kv staging pages").bytes == 0  # rk4: per token


def test_layout_aligns_and_round_trips():
    layout = Layout.pack([("a", torch.float32, (3,)), ("b", torch.uint8, (5, 7)),
                          ("c", torch.float16, (0,))])
    assert all(s.offset % ALIGNMENT == 0 for s in layout.tensors)
    assert Layout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match="overlaps"):
        Layout.from_dict({"tensors": [{"name": "x", "dtype": "float32", "shape": [4],
                                       "offset": 8}], "total_bytes": 512})


def test_arenas_round_trip_model_and_cache_without_copies():
    loaded = load_model("tiny-qwen3.5", seed=1)
    fmt = KVFormatSpec("int8")
    shape = CacheShape(8, 4, 3)
    arenas = create_arenas(loaded.model, loaded.config, shape, fmt.build(), "cpu",
                           f"tandem-test-{os.getpid()}")
    try:
        names = {a.handle.shm_path for a in arenas.by_name().values()}
        assert all(os.path.exists(n) for n in names)
        mapped = open_arenas(arenas.handles())
        config = config_from_json(config_to_json(loaded.config))
        model = model_on_arena(config, mapped, torch.float32, "test")
        assert all(mapped.weights.contains(p) for p in model.parameters())
        cache = cache_on_arenas(config, shape, fmt.build(), mapped)
        assert mapped.kv.contains(cache.kv[0]["k_codes"])
        # a write through one mapping is seen through the other
        cache.recurrent_state(0)[2].fill_(7.0)
        assert arenas.state.tensor("recurrent.0")[2].eq(7.0).all()
        assert kv_layout(config, shape, fmt.build()).names == ["kv.3.k_codes", "kv.3.k_scales",
                                                               "kv.3.v_codes", "kv.3.v_scales"]
    finally:
        arenas.close()
    assert not any(os.path.exists(n) for n in names)


def test_mapping_a_missing_or_foreign_file_fails_loudly(tmp_path):
    layout = Layout.pack([("x", torch.float32, (4,))])
    arena = Arena.create("probe", layout, "cpu", f"tandem-test-{os.getpid()}")
    handle = arena.handle
    try:
        # same size, different bytes: the canary catches it
        other = Arena.create("other", layout, "cpu", f"tandem-test-{os.getpid()}")
        foreign = type(handle)(layout, handle.canary, shm_path=other.handle.shm_path)
        with pytest.raises(ArenaMapError, match="canary"):
            Arena.open("probe", foreign)
        other.close()
    finally:
        arena.close()
    with pytest.raises(ArenaMapError, match="does not exist"):
        Arena.open("probe", handle)
    assert not os.path.exists(handle.shm_path)  # mapping never creates the file
    assert not list(SHM_DIR.glob(f"tandem-test-{os.getpid()}-*"))


def test_speculation_sizes_mtp_pages_and_draft_slots():
    """The MTP drafter's KV is one more page pool per MTP layer, and each live
    sequence holds one spare GDN slot per draft position; both are planned."""
    from engine.config import ModelConfig, shape_hf_config
    from kvstore.memory import KVFormatSpec

    cfg = ModelConfig.from_hf(shape_hf_config("qwen3.5-27b"))
    assert cfg.mtp_num_layers == 1
    common = dict(config=cfg, kv_format=KVFormatSpec("int8"), page_size=16,
                  max_context_tokens=65536, live_slots=4, snapshot_slots=8,
                  gpu_memory_budget=None, weight_bytes=0)
    plain = CapacityPlan(**common)
    spec = CapacityPlan(**common, draft_slots_per_sequence=3, mtp_kv_layers=1)
    per_layer = plain.line("kv pages").bytes // len(cfg.attention_layers)
    assert spec.line("mtp kv pages").bytes == per_layer and plain.line("mtp kv pages").bytes == 0
    assert spec.line("gdn draft slots").bytes == 12 * plain.line("gdn live slots").bytes // 4
    assert spec.num_state_slots == plain.num_state_slots + 12
    assert spec.cache_shape.mtp_layers == 1


def test_each_gpu_process_costs_a_cuda_context():
    """A plan for the GPU service counts the CUDA context of each of its GPU
    processes (NVML's per-process figure, not PyTorch's allocator)."""
    from kvstore.plan import CUDA_CONTEXT_BYTES, SERVICE_CUDA_PROCESSES

    cpu = _plan(_qwen27b(), 14 * GiB)
    gpu = _plan(_qwen27b(), 14 * GiB, cuda_processes=SERVICE_CUDA_PROCESSES)
    assert cpu.line("cuda contexts").bytes == 0
    # NVML after a cuBLAS matmul with the stack reservation trimmed: 526 MiB
    assert gpu.line("cuda contexts").bytes == 3 * CUDA_CONTEXT_BYTES >= 3 * 526 * 2**20
    assert gpu.total_bytes - cpu.total_bytes == 3 * CUDA_CONTEXT_BYTES
    assert "3 processes" in gpu.table()


def test_gpu_prefill_workspace_is_planned_for_quantized_pages_only():
    """On the GPU a prefill dequantizes one layer's K/V into a bf16 workspace of
    at most DENSE_PREFILL_MAX_TOKENS (plus one read slice's temporaries) for
    quantized pages and none for bf16 pages; the CPU path the whole context."""
    from engine.kv.attention import (DENSE_PREFILL_MAX_TOKENS, DENSE_READ_SLICE_TOKENS,
                                     PREFILL_KEY_SPLITS)

    config = _qwen27b()
    kv_width = config.num_kv_heads * config.head_dim

    def plan(**kw):
        return _plan(config, 13 * 10**9, budget="200GiB", **kw)

    def reserve(**kw) -> int:
        return plan(**kw).line("activation reserve").bytes

    gpu_rk4 = reserve(paged_attention_kernel=True)
    gpu_bf16 = reserve(paged_attention_kernel=True, kv_format=KVFormatSpec("bf16"))
    cpu_rk4 = reserve()
    assert gpu_rk4 - gpu_bf16 == (2 * DENSE_PREFILL_MAX_TOKENS * kv_width * 2
                                  + DENSE_READ_SLICE_TOKENS * kv_width * 24)
    # the GPU path also holds a short chunk's split-key partials (fp32 out + lse)
    chunk = plan().prefill_chunk_tokens
    partials = chunk * config.num_heads * PREFILL_KEY_SPLITS * (config.head_dim + 1) * 4
    assert cpu_rk4 - (gpu_bf16 - partials) == 2 * 262_144 * kv_width * 2


def test_the_gdn_prefill_kernels_are_planned_with_their_own_working_set(monkeypatch):
    """fla-core's chunked GDN kernels hold a third of the PyTorch chunked
    rule's fp32 working set per chunk token; the store's plan counts the one
    the prefill worker will run (fla importable and a GPU), and says so."""
    import kvstore.server as server
    from engine.speculative import SpeculativeConfig
    from kvstore.plan import GDN_PREFILL_FP32_TENSORS, GDN_PREFILL_KERNEL_FP32_TENSORS

    config = _qwen27b()
    chunk = 2048
    per_tensor = chunk * config.linear_num_v_heads * config.linear_v_head_dim * 4

    def reserve(**kw) -> int:
        return _plan(config, 13 * 10**9, budget="200GiB", prefill_chunk_tokens=chunk,
                     paged_attention_kernel=True, **kw).line("activation reserve").bytes

    assert GDN_PREFILL_KERNEL_FP32_TENSORS < GDN_PREFILL_FP32_TENSORS
    assert reserve() - reserve(gdn_prefill_kernel=True) == \
        (GDN_PREFILL_FP32_TENSORS - GDN_PREFILL_KERNEL_FP32_TENSORS) * per_tensor
    dense = _plan(_dense_config(), 10**9, budget="200GiB", gdn_prefill_kernel=True,
                  kv_format=KVFormatSpec("int8"))
    assert "fla-core" not in dense.line("activation reserve").detail

    def store_plan(device: str, fla: bool) -> CapacityPlan:
        monkeypatch.setattr(server, "fla_available", lambda: fla)
        options = server.ServerOptions(
            socket="(plan)", model="qwen3.5-27b", kv_format="rk4", max_context_tokens=262_144,
            live_slots=1, snapshot_slots=4, gpu_memory_budget=parse_bytes("24GiB"),
            device=device, prefill_chunk_tokens=chunk,
            speculative=SpeculativeConfig(method="mtp", num_draft_tokens=3))
        return server.plan_for(options, config, torch.bfloat16, 15 * GiB)

    assert store_plan("cuda", fla=True).gdn_prefill_kernel
    assert "GDN by fla-core's kernels" in store_plan("cuda", fla=True).table()
    assert not store_plan("cuda", fla=False).gdn_prefill_kernel
    assert not store_plan("cpu", fla=True).gdn_prefill_kernel  # the CPU runs the PyTorch rule


def test_an_auto_prefill_chunk_is_the_largest_up_to_its_cap_that_fits(monkeypatch):
    """--prefill-chunk auto (the default): on a GPU the largest chunk up to
    AUTO_PREFILL_CHUNK_CAP the budget fits, so 4-bit weights prefill in the
    chunks they are fastest in without passing the budget; on the CPU 512;
    a chunk given is planned as given."""
    import argparse

    import kvstore.server as server
    from engine.chunking import (AUTO_PREFILL_CHUNK, AUTO_PREFILL_CHUNK_CAP,
                                 AUTO_PREFILL_CHUNK_CPU, parse_prefill_chunk)
    from kvstore.plan import PREFILL_CHUNK_CHOICES
    from engine.speculative import SpeculativeConfig

    monkeypatch.setattr(server, "fla_available", lambda: True)
    inputs = plan_inputs("qwen3.5-27b", "int4", torch.device("cuda"))  # no weights made
    config = inputs.config

    def store_plan(device="cuda", chunk="auto", budget="24GiB") -> CapacityPlan:
        options = server.ServerOptions(
            socket="(plan)", model="qwen3.5-27b", kv_format="rk4", max_context_tokens=262_144,
            live_slots=1, snapshot_slots=4, device=device,
            gpu_memory_budget=parse_bytes(budget) if budget else None,
            prefill_chunk_tokens=parse_prefill_chunk(chunk),
            speculative=SpeculativeConfig(method="mtp", num_draft_tokens=3))
        return server.plan_for(options, config, torch.bfloat16, inputs.weight_bytes,
                               inputs.label, inputs.embedding_bytes, inputs.packed_in_features)

    auto = store_plan()
    auto.check()
    assert auto.prefill_chunk_tokens == auto.largest_fitting_chunk(up_to=AUTO_PREFILL_CHUNK_CAP)
    assert auto.prefill_chunk_tokens > 512  # the 24 GiB / 262K plan fits a chunk past the old default
    assert "(auto: the largest up to" in auto.table()
    tight = store_plan(budget="23GiB")
    assert tight.prefill_chunk_tokens < auto.prefill_chunk_tokens and tight.spare_bytes >= 0
    assert store_plan(budget=None).prefill_chunk_tokens == AUTO_PREFILL_CHUNK_CAP
    on_cpu = store_plan(device="cpu", budget=None)
    assert on_cpu.prefill_chunk_tokens == AUTO_PREFILL_CHUNK_CPU and on_cpu.chunk_auto
    assert f"prefill chunk {AUTO_PREFILL_CHUNK_CPU} tokens (auto: the CPU's)" in on_cpu.table()
    given = store_plan(chunk="4096")
    assert given.prefill_chunk_tokens == 4096 and not given.chunk_auto
    assert "auto" not in given.table().split("activation reserve")[1].splitlines()[0]
    with pytest.raises(OverBudgetError):  # as given, not lowered to fit
        given.check()
    # nothing fits: the smallest chunk, so that check() names a line that a
    # smaller chunk would not fix
    hopeless = store_plan(budget="8GiB")
    assert hopeless.prefill_chunk_tokens == PREFILL_CHUNK_CHOICES[-1]
    with pytest.raises(OverBudgetError, match="over budget: weights"):
        hopeless.check()
    with pytest.raises(OverBudgetError, match="over budget: cuda contexts"):
        store_plan(budget="22GiB").check()
    assert parse_prefill_chunk("auto") == parse_prefill_chunk(" AUTO ") == AUTO_PREFILL_CHUNK
    assert parse_prefill_chunk("256") == 256
    for bad in ("0", "-5", "1k", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="auto or a number of tokens"):
            parse_prefill_chunk(bad)


def test_every_flag_the_advice_names_parses_in_plan_and_serve():
    """The advice is printed by `tandem plan` and by `tandem serve` (its store
    refuses to start): each flag it names must parse in both. `tandem plan`
    rejected --max-context-tokens (its flag was --context)."""
    import re

    from tandem.cli import build_parser

    values = {"--max-context-tokens": "4096", "--kv-format": "rk4", "--live-slots": "2",
              "--snapshot-slots": "2", "--prefill-chunk": "256", "--draft-tokens": "2",
              "--speculative": "ngram", "--weights": "q4_k_m", "--gpu-memory-budget": "24GiB"}
    plans = [_plan(_qwen27b(), 14 * GiB, kv_format=KVFormatSpec("rk4p"), page_size=32),
             _plan(_dense_config(), 1, kv_format=KVFormatSpec("int8"))]
    named = {flag for plan in plans for line in plan.lines
             for flag in re.findall(r"--[a-z][a-z-]*", line.lower)}
    assert "--max-context-tokens" in named
    for flag in sorted(named):
        assert flag in values, f"no sample value for {flag}: add one"
        for command in (["plan", "--gpu-memory-budget", "24GiB"], ["serve"]):
            args = build_parser().parse_args([*command, flag, values[flag]])
            dest = "context" if (command[0], flag) == ("plan", "--max-context-tokens") \
                else flag[2:].replace("-", "_")
            assert str(getattr(args, dest)) == values[flag], (command[0], flag)


def test_dense_speculation_plans_the_verify_rows():
    """A verify step runs k + 1 rows a sequence (decode/warmup.py, the
    scheduler) for dense models too, which hold no spare GDN slots: the
    rows came from draft_slots_per_sequence, 0 for a dense model."""
    config = _dense_config()
    plain = _plan(config, 1, budget="64GiB", live_slots=4, kv_format=KVFormatSpec("int8"))
    spec = _plan(config, 1, budget="64GiB", live_slots=4, kv_format=KVFormatSpec("int8"),
                 draft_tokens=3)
    per_row = plain.line("decode activations").bytes // 4
    assert spec.line("decode activations").bytes == 4 * 4 * per_row
    assert "4 x 4 rows" in spec.line("decode activations").detail
    assert spec.line("gdn draft slots").bytes == 0  # no recurrent state to keep
    assert "3 draft tokens" in spec.table()
    # a hybrid plan's spare slots and verify rows agree, whichever is given
    hybrid = dict(budget="200GiB", live_slots=4)
    assert _plan(_qwen27b(), 1, draft_tokens=3, draft_slots_per_sequence=3, **hybrid).lines == \
        _plan(_qwen27b(), 1, draft_slots_per_sequence=3, **hybrid).lines
    with pytest.raises(ValueError, match="draft_tokens"):
        _plan(config, 1, draft_tokens=-1)


def test_tandem_plan_counts_the_verify_rows_of_a_dense_model(capsys):
    from tandem.cli import main

    assert main(["plan", "--model", "tiny-llama", "--speculative", "ngram", "--draft-tokens",
                 "3", "--live-slots", "2", "--device", "cpu", "--gpu-memory-budget", "1GiB"]) == 0
    assert "2 x 4 rows" in capsys.readouterr().out


def test_a_budget_too_large_to_mean_anything_is_refused(capsys):
    """float('1e400') is inf: int() raised OverflowError (a traceback)."""
    from tandem.cli import main

    for text in ("1e400", "1e30", "1e400GiB", "99999999999TiB"):
        with pytest.raises(ValueError, match="too large"):
            parse_bytes(text)
    assert parse_bytes("1024TiB") == 1 << 50
    assert main(["plan", "--gpu-memory-budget", "1e400"]) == 2
    assert "too large" in capsys.readouterr().err


def test_store_options_are_checked_when_made():
    """ServerOptions says it is validated on creation: a bad format or size is
    a ValueError naming the flag, not a failure deep in start-up."""
    from kvstore.server import ServerOptions

    for bad, flag in (({"kv_format": "nope"}, "--kv-format"),
                      ({"max_context_tokens": -5}, "--max-context-tokens"),
                      ({"live_slots": 0}, "--live-slots"),
                      ({"snapshot_slots": -1}, "--snapshot-slots"),
                      ({"page_size": 0}, "--page-size"),
                      ({"gpu_memory_budget": -7}, "--gpu-memory-budget")):
        with pytest.raises(ValueError, match=flag):
            ServerOptions(socket="s", **bad)
    assert ServerOptions(socket="s").kv_format == "int8"
