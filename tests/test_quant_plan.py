"""`tandem plan`: the memory plan of a configuration, from configs and tensor
tables alone, for the 27B shape in the 24 GiB budget the mission names."""
from __future__ import annotations

import re

import pytest
import torch

from engine.config import ModelConfig, shape_hf_config
from engine.loader import plan_inputs
from engine.weights.gguf import embedded_model_path, gguf_plan_inputs
from kvstore.plan import GiB, weight_bytes_of
from tandem.cli import main

PLAN_27B = ["plan", "--model", "qwen3.5-27b", "--kv-format", "rk4", "--context", "262144",
            "--speculative", "mtp", "--draft-tokens", "3", "--snapshot-slots", "2",
            "--gpu-memory-budget", "24GiB"]


def _bytes(text: str, line: str) -> float:
    m = re.search(rf"^\s*{line}\s+([0-9.]+) (GiB|MiB|KiB)", text, re.M)
    assert m, f"no line {line!r} in:\n{text}"
    return float(m.group(1)) * {"GiB": GiB, "MiB": 1 << 20, "KiB": 1 << 10}[m.group(2)]


def test_27b_int4_rk4_full_context_plan_lists_every_line(capsys):
    """The 24 GiB demonstration's plan, CUDA contexts included: fits with the
    issue's 1 GiB to spare at 512-token chunks, the token table in host
    memory; the auto chunk spends part of that spare on a larger chunk and
    still fits; on the device the table costs what its plan line says, and
    at 23 GiB the plan is refused."""
    assert main([*PLAN_27B, "--weights", "int4", "--device", "cuda"]) == 0
    auto = capsys.readouterr().out
    assert "(auto: the largest up to 2048 that fits)" in auto and _bytes(auto, "spare") > 0
    assert re.search(r"prefill chunk (1024|2048) tokens", auto)  # 2048 where fla-core is installed
    assert main([*PLAN_27B, "--weights", "int4", "--device", "cuda", "--prefill-chunk", "512"]) == 0
    out = capsys.readouterr().out
    for line in ("weights", "kv pages", "mtp kv pages", "gdn live slots", "gdn snapshot slots",
                 "gdn draft slots", "activation reserve", "decode activations", "cuda graphs",
                 "allocator slack", "cuda contexts"):
        assert _bytes(out, line) > 0, line
    assert _bytes(out, "spare") >= 1 * GiB and "token table" in out
    assert 21 * GiB < _bytes(out, "total") <= 23 * GiB
    assert 13 * GiB < _bytes(out, "weights") < 16 * GiB  # ~27B weights at 4.625 bits
    table = 248320 * 5120 * 4.625 / 8  # Q4_K rows of the 27B's vocabulary
    assert main([*PLAN_27B, "--weights", "int4", "--device", "cuda", "--prefill-chunk", "512",
                 "--embeddings", "device"]) == 0
    on_device = capsys.readouterr().out
    assert _bytes(on_device, "weights") - _bytes(out, "weights") == pytest.approx(table, rel=0.01)
    assert _bytes(on_device, "total") - _bytes(out, "total") == pytest.approx(table, rel=0.01)
    assert main([*PLAN_27B, "--weights", "int4", "--device", "cuda", "--embeddings", "device",
                 "--snapshot-slots", "4", "--gpu-memory-budget", "23GiB"]) == 1
    assert "over budget: cuda contexts" in capsys.readouterr().err


def test_27b_bf16_weights_do_not_fit_and_the_message_says_what_to_change(capsys):
    assert main([*PLAN_27B, "--weights", "bf16"]) == 1
    err = capsys.readouterr().err
    assert "over budget: weights" in err and "does not fit" in err
    assert "--weights q4_k_m" in err  # what to change
    assert "<- does not fit" in err and "24.00 GiB" in err


def test_plan_names_the_context_line_when_the_kv_pool_is_what_overflows(capsys):
    assert main([*PLAN_27B, "--weights", "int4", "--kv-format", "bf16"]) == 1
    err = capsys.readouterr().err
    assert "over budget: kv pages" in err and "--kv-format" in err


def test_bad_input_exits_2(capsys):
    assert main([*PLAN_27B, "--weights", "q5_x"]) == 2
    assert "--weights 'q5_x'" in capsys.readouterr().err
    assert main(["plan", "--gpu-memory-budget", "24 parsecs"]) == 2


def test_recipe_bytes_follow_the_packed_layout():
    config = ModelConfig.from_hf(shape_hf_config("qwen3.5-27b"))
    dense = weight_bytes_of(config, torch.bfloat16, "bf16")
    int4 = weight_bytes_of(config, torch.bfloat16, "int4")
    params = dense / 2
    # 4-bit codes + per 32: sc, m bytes + per 256: fp16 d, dmin; norms etc. stay bf16
    assert int4 == pytest.approx(params * 4.625 / 8, rel=0.01)
    assert weight_bytes_of(config, torch.bfloat16, "q4_k_m") > int4


def test_gguf_plan_reads_only_the_tensor_table():
    config, packed, _, packed_table, packed_k = plan_inputs(None, "native", "cuda")
    _, dense, _, dense_table, dense_k = plan_inputs(None, "bf16", "cuda")
    assert config.hidden_size == 576
    # the longest packed row: the MLP's down projection (K = 1,536); none when dequantized
    assert (packed_k, dense_k) == (1536, 0)
    # SmolLM2's token table, 49152 x 576: Q8_0 in the file (34 bytes per 32), bf16 dequantized
    assert dense_table == 49152 * 576 * 2 and packed_table < dense_table
    # Q4_1 matrices stay 4-bit + scales; bf16 is 16 bits (both count the shipped
    # MTP head's bf16 weights too, as loading does)
    head = dense - gguf_plan_inputs(embedded_model_path(), False, torch.bfloat16)[1]
    assert head == packed - gguf_plan_inputs(embedded_model_path(), True, torch.bfloat16)[1] > 0
    assert packed - head < (dense - head) / 2.5


def test_the_embedded_models_trained_head_is_planned_as_serve_loads_it(capsys):
    """--speculative mtp on the embedded model: `tandem serve` picks up the
    shipped head, so the plan must too (it refused, "this model has none"),
    with the head's layer in the MTP KV line and its weights in the weights."""
    assert main(["plan", "--speculative", "mtp", "--device", "cpu",
                 "--gpu-memory-budget", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"mtp kv pages .* x 1 MTP layers", out), out
    with_head = plan_inputs(None, "bf16", "cpu")
    assert with_head.config.mtp_num_layers == 1
    head_parameters = 1152 * 576 + 3 * 576 + (576 * (576 + 2 * 192 + 576) + 3 * 576 * 1536
                                              + 2 * 576)
    _, gguf_alone, *_ = gguf_plan_inputs(embedded_model_path(), False, torch.float32)
    assert with_head.weight_bytes - gguf_alone == head_parameters * 4  # fp32 on the CPU


def test_the_plan_counts_the_prefill_weight_workspace_only_for_packed_weights(monkeypatch):
    """A packed model on a GPU holds one dequantized weight slice for cuBLAS
    (engine/quant/workspace.py); dense weights, or the workspace switched
    off, hold none."""
    from kvstore.server import ServerOptions, plan_for
    from engine.loader import plan_inputs
    from engine.quant.workspace import WORKSPACE_ENV

    def reserve(weights: str) -> int:
        options = ServerOptions(socket="unused", model="qwen3.5-27b", weights=weights,
                                device="cuda", gpu_memory_budget=None)
        inputs = plan_inputs("qwen3.5-27b", weights, "cuda")
        plan = plan_for(options, inputs.config, torch.bfloat16, inputs.weight_bytes, inputs.label,
                        packed_in_features=inputs.packed_in_features)
        line = plan.line("activation reserve")
        assert ("dequantized weights" in line.detail) == (plan.weight_workspace_bytes > 0)
        return line.bytes

    packed, dense = reserve("int4"), reserve("bf16")
    # the budget bounds every weight's slice (a tile of the widest K, 17,408, is far less)
    from engine.quant.workspace import workspace_bytes
    assert packed - dense == workspace_bytes() == 256 << 20
    monkeypatch.setenv(WORKSPACE_ENV, "0")
    assert reserve("int4") == dense


def test_a_gguf_with_no_low_bit_matrix_plans_no_weight_workspace(tmp_path):
    """A file whose matrices are all F32 loads dense even when asked to keep
    its weights packed: the plan holds no dequantization workspace for it
    (it planned one for any file loaded with --weights native)."""
    from kvstore.server import ServerOptions, plan_for
    from tests.test_gguf import write_tiny_gguf

    def workspace(path) -> int:
        inputs = plan_inputs(str(path), "native", "cuda")
        options = ServerOptions(socket="unused", model=str(path), weights="native",
                                device="cuda", gpu_memory_budget=None)
        return plan_for(options, inputs.config, torch.bfloat16, inputs.weight_bytes,
                        inputs.label, packed_in_features=inputs.packed_in_features
                        ).weight_workspace_bytes

    write_tiny_gguf(tmp_path / "f32.gguf", "llama")
    write_tiny_gguf(tmp_path / "q8.gguf", "llama",
                    types=lambda n: "Q8_0" if n == "blk.0.ffn_down.weight" else None)
    assert plan_inputs(str(tmp_path / "f32.gguf"), "native", "cuda").packed_in_features == 0
    assert workspace(tmp_path / "f32.gguf") == 0
    assert workspace(tmp_path / "q8.gguf") > 0
