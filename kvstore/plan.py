"""The KV store's capacity plan: how many bytes each part of the store needs,
checked against a memory budget before anything is allocated.

Owns the sizing formulas and the over-budget message. Exact for the arenas
(weights, KV pages, GDN slots: the same layouts the store allocates); an
estimate, with its formula stated, for what workers need beside them
(activations) and for allocator slack. Must not allocate memory, load weights
or know about processes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from engine.cache import CacheShape
from engine.chunking import AUTO_PREFILL_CHUNK_CAP, AUTO_PREFILL_CHUNK_CPU
from engine.config import ModelConfig
from engine.errors import TandemError
from engine.kv.attention import (DENSE_READ_SLICE_TOKENS, PREFILL_KEY_SPLITS,
                                 dense_prefill_max_tokens)
from engine.kv.open_pages import sink_pages, staging_per_sequence
from kvstore.arena import HEADER_BYTES
from kvstore.memory import KVFormatSpec, kv_layout, state_layout

GiB = 1 << 30
MiB = 1 << 20
# Caching-allocator rounding and fragmentation, cuBLAS and Triton workspaces.
# The CUDA context itself (~0.5 GiB per process) is outside torch's allocator:
# leave it out of --gpu-memory-budget.
SLACK_FIXED_BYTES = 256 * MiB
# What one process holds outside PyTorch's allocator once it has run a cuBLAS
# matmul: CUDA context, cuBLAS handle and kernel modules, with the thread-stack
# reservation trimmed as every service process does (engine/cuda_context.py).
# NVML on the H200 (CUDA 13, torch 2.11, scripts/device_context.py --stack 64):
# 364 MiB for the context, 526 MiB after the first bf16 matmul (612 and 774 MiB
# untrimmed); rounded up.
CUDA_CONTEXT_BYTES = 560 * MiB
# The service's processes that touch the GPU: kvstore, prefill, decode (the
# router and the HTTP gateway never initialise CUDA).
SERVICE_CUDA_PROCESSES = 3
SLACK_ACTIVATION_FRACTION = 0.10
# fp32 [tokens, v_heads, head_dim] tensors a GDN prefill chunk holds at once
# (see CapacityPlan._gdn_prefill_bytes_per_token): the chunked PyTorch rule,
# and fla-core's chunked kernels (the CUDA prefill where fla is installed).
GDN_PREFILL_FP32_TENSORS = 24
GDN_PREFILL_KERNEL_FP32_TENSORS = 8


# The prefill chunks the plan tries when it says which one the budget fits:
# with 4-bit weights a chunk dequantizes every weight matrix once, so larger
# chunks prefill faster (the 27B's 4K prompt on an H100, 12-05: 512 tokens
# 3,492 tok/s, 1,024 4,748, 4,096 10,141), and they cost activation memory.
PREFILL_CHUNK_CHOICES = (8192, 4096, 2048, 1024, 512, 256, 128)


class OverBudgetError(TandemError):
    """The capacity plan does not fit the memory budget; the message is the plan."""


@dataclass(frozen=True)
class PlanLine:
    name: str
    bytes: int
    detail: str  # how the number was made, for the table
    lower: str   # what to lower when this line does not fit


@dataclass(frozen=True)
class CapacityPlan:
    """All memory the store and its workers need, validated on creation.

    max_context_tokens: tokens the page pool holds across all sequences and the
    prefix cache together. live_slots + snapshot_slots: the one GDN slot pool
    (hybrid models; ignored for dense ones). draft_slots_per_sequence: spare
    GDN slots each running sequence holds for speculative verify (one per
    draft position; 0 without speculation). draft_tokens: k, the draft tokens
    a verify step checks per sequence whenever speculation is on, dense models
    included (they hold no spare slots but still verify k + 1 rows a step).
    mtp_kv_layers: MTP layers whose
    KV gets a page pool (the MTP drafter), indexed by the same page tables. gpu_memory_budget: bytes, None for
    no limit. weight_bytes: the weights as stored (see weight_bytes_of).
    activation_bytes: bytes per activation element in workers (2 for bf16).

    Activation reserve (an estimate, per worker forward):
      prefill_chunk_tokens x (6 hidden + 3 intermediate + q_width + 2 kv_width
                              + 2 conv_dim) x activation_bytes     the widest layer's live tensors
      + prefill_chunk_tokens x 24 x gdn_v_heads x gdn_head_dim x 4  the GDN chunk's fp32 work
        (8 instead of 24 with gdn_prefill_kernel: fla-core's chunked kernels)
      + 2 x context x kv_heads x head_dim x activation_bytes      one layer's K and V dequantized
        (the PyTorch path; with paged_attention_kernel, prefill over quantized pages
        dequantizes at most DENSE_PREFILL_MAX_TOKENS, and a read slice's fp32
        temporaries, DENSE_READ_SLICE_TOKENS x kv_heads x head_dim x 24 bytes)
      + prefill_chunk_tokens x q_heads x PREFILL_KEY_SPLITS x (head_dim + 1) x 4
                                                 a short chunk's split-key partials (GPU)
      + live_slots x vocab x 4                                    fp32 logits of a decode batch
      + weight_workspace_bytes        packed weights on a GPU: the slice of a weight a prefill
                                      chunk dequantizes for cuBLAS (engine/quant/workspace.py)
    where context = min(max_context_tokens, max_position_embeddings).
    Allocator slack: 256 MiB + 10% of the activation reserve (and of the
    decode activations).

    Decode activations (the decode worker, beside the prefill worker's reserve):
      rows x (per-token widths above) x activation_bytes + rows x vocab x 4
      where rows = live_slots x (1 + k) (a verify step; k = draft_tokens, or
      draft_slots_per_sequence where only that is given).
    CUDA contexts: cuda_processes x CUDA_CONTEXT_BYTES (measured).
    CUDA graphs (cuda_graphs=True): one private pool per captured batch size
      (1, 2, 4, ... up to live_slots), each sized like the decode activations
      of that batch, + 64 MiB of graph bookkeeping.
    weight_format names how weight_bytes was counted (for the table).
    host_weight_bytes: the part of weight_bytes kept in host memory (the
    token table of an untied model on a GPU, kvstore/memory.py): not on the GPU.
    """

    config: ModelConfig
    kv_format: KVFormatSpec
    page_size: int
    max_context_tokens: int
    live_slots: int
    snapshot_slots: int
    gpu_memory_budget: int | None
    weight_bytes: int
    prefill_chunk_tokens: int = 2048
    activation_bytes: int = 2
    draft_slots_per_sequence: int = 0
    draft_tokens: int = 0
    mtp_kv_layers: int = 0
    cuda_graphs: bool = False
    cuda_processes: int = 0
    # attention reads the pages in place (the Triton kernels on CUDA): a layer's
    # K and V are dequantized whole only for prefill, up to a bound
    # (engine/kv/attention.py); False: the PyTorch path always does
    paged_attention_kernel: bool = False
    weight_format: str = "as stored"
    host_weight_bytes: int = 0
    weight_workspace_bytes: int = 0
    # the GDN prefill runs fla-core's chunked kernels (engine/gdn_batched.py),
    # whose working set is a third of the PyTorch chunked rule's
    gdn_prefill_kernel: bool = False
    # the chunk was --prefill-chunk auto's, for the table: on a GPU (cuda_processes)
    # with_auto_chunk's pick, on the CPU engine/chunking's AUTO_PREFILL_CHUNK_CPU
    chunk_auto: bool = False
    lines: tuple[PlanLine, ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        object.__setattr__(self, "lines", self._compute_lines())

    # ----------------------------------------------------------- derived

    @property
    def num_pages(self) -> int:
        return -(-self.max_context_tokens // self.page_size)

    @property
    def num_draft_slots(self) -> int:
        return self.live_slots * self.draft_slots_per_sequence if self.config.is_hybrid else 0

    @property
    def verify_rows_per_sequence(self) -> int:
        """Rows a decode step runs per sequence: its token and, speculating,
        the k drafts it verifies (a hybrid model's k spare slots say k too)."""
        return 1 + max(self.draft_tokens, self.draft_slots_per_sequence)

    @property
    def num_state_slots(self) -> int:
        if not self.config.is_hybrid:
            return 0
        return self.live_slots + self.snapshot_slots + self.num_draft_slots

    @property
    def num_staging_pages(self) -> int:
        """bf16 staging pages under a format that quantizes whole pages (rk4p):
        each live sequence's sink and open pages, and as many sink pages again
        for the prefix cache to keep (prefixes that share their first page
        share one; evicting one frees its whole subtree)."""
        fmt = self.kv_format.build()
        per_sequence = staging_per_sequence(fmt)
        return self.live_slots * (per_sequence + sink_pages(fmt)) if per_sequence else 0

    @property
    def cache_shape(self) -> CacheShape:
        return CacheShape(self.num_pages, self.page_size, self.num_state_slots, self.mtp_kv_layers,
                          self.num_staging_pages)

    @property
    def total_bytes(self) -> int:
        return sum(line.bytes for line in self.lines)

    def line(self, name: str) -> PlanLine:
        return next(line for line in self.lines if line.name == name)

    # -------------------------------------------------------------- check

    def check(self) -> None:
        """Raise OverBudgetError naming the first line that does not fit."""
        if self.gpu_memory_budget is None:
            return
        used = 0
        for line in self.lines:
            used += line.bytes
            if used > self.gpu_memory_budget:
                raise OverBudgetError(self._over_budget_message(line, used))

    @property
    def spare_bytes(self) -> int | None:
        return None if self.gpu_memory_budget is None else self.gpu_memory_budget - self.total_bytes

    def largest_fitting_chunk(self, up_to: int | None = None) -> int | None:
        """The largest prefill chunk of PREFILL_CHUNK_CHOICES (up to `up_to`)
        with which this plan fits its budget, everything else as it is (None:
        no budget, or not even the smallest fits)."""
        if self.gpu_memory_budget is None:
            return None
        return next((chunk for chunk in PREFILL_CHUNK_CHOICES
                     if (up_to is None or chunk <= up_to)
                     and replace(self, prefill_chunk_tokens=chunk).spare_bytes >= 0), None)

    def with_auto_chunk(self) -> CapacityPlan:
        """This plan with --prefill-chunk auto, the one place that picks it:
        on a GPU (cuda_processes) the largest chunk up to
        AUTO_PREFILL_CHUNK_CAP that its budget fits, the cap without a
        budget; when not even the smallest fits, the smallest, so that
        check() names a line that lowering the chunk would not fix. On the
        CPU, engine/chunking's AUTO_PREFILL_CHUNK_CPU (no budget to fit)."""
        if not self.cuda_processes:
            return replace(self, prefill_chunk_tokens=AUTO_PREFILL_CHUNK_CPU, chunk_auto=True)
        best = AUTO_PREFILL_CHUNK_CAP if self.gpu_memory_budget is None else \
            self.largest_fitting_chunk(up_to=AUTO_PREFILL_CHUNK_CAP)
        return replace(self, prefill_chunk_tokens=best or PREFILL_CHUNK_CHOICES[-1],
                       chunk_auto=True)

    def _auto_chunk_note(self) -> str:
        if not self.chunk_auto:
            return ""
        if self.cuda_processes:
            return f" (auto: the largest up to {AUTO_PREFILL_CHUNK_CAP} that fits)"
        return " (auto: the CPU's)"

    def _chunk_advice(self) -> str:
        """A line naming a prefill chunk other than the planned one that the
        budget fits: a larger one (faster prefill) when the plan fits, a
        smaller one when it does not; empty when there is none to name."""
        best = self.largest_fitting_chunk()
        if best is None or best == self.prefill_chunk_tokens:
            return ""
        if best > self.prefill_chunk_tokens:
            return (f"this budget also fits --prefill-chunk {best} (now "
                    f"{self.prefill_chunk_tokens}): larger chunks prefill faster, most of "
                    "all with 4-bit weights")
        return (f"--prefill-chunk {best} fits this budget with everything else as it is "
                f"(now {self.prefill_chunk_tokens})")

    def table(self, mark: str | None = None) -> str:
        """The plan as a small text table; `mark` flags one line."""
        drafts = self.verify_rows_per_sequence - 1
        spec = f", {drafts} draft tokens" if drafts else ""
        head = (f"capacity plan (all processes): {self.config.model_type}, "
                f"{self.config.num_layers} layers "
                f"({len(self.config.attention_layers)} full attention, "
                f"{len(self.config.linear_layers)} GDN), weights {self.weight_format}, "
                f"KV format {self.kv_format.describe()}, page size {self.page_size}, "
                f"context {self.max_context_tokens} tokens{spec}")
        width = max(len(line.name) for line in self.lines)
        rows, used = [head], 0
        for line in self.lines:
            used += line.bytes
            flag = "  <- does not fit" if line.name == mark else ""
            rows.append(f"  {line.name:<{width}}  {format_bytes(line.bytes):>11}  "
                        f"(cumulative {format_bytes(used):>11})  {line.detail}{flag}")
        rows.append(f"  {'total':<{width}}  {format_bytes(self.total_bytes):>11}")
        budget = ("unlimited" if self.gpu_memory_budget is None
                  else format_bytes(self.gpu_memory_budget))
        rows.append(f"  {'budget':<{width}}  {budget:>11}")
        if self.spare_bytes is not None and self.spare_bytes >= 0:
            rows.append(f"  {'spare':<{width}}  {format_bytes(self.spare_bytes):>11}")
            if advice := self._chunk_advice():
                rows.append(f"  {advice}")
        return "\n".join(rows)

    def _over_budget_message(self, line: PlanLine, used: int) -> str:
        over = used - self.gpu_memory_budget
        return (f"{self.table(mark=line.name)}\n"
                f"over budget: {line.name} ({format_bytes(line.bytes)}) does not fit: the "
                f"lines up to it need {format_bytes(used)} of the "
                f"{format_bytes(self.gpu_memory_budget)} budget ({format_bytes(over)} over); "
                f"{line.lower}" + (f"\n{advice}" if (advice := self._chunk_advice()) else ""))

    # ------------------------------------------------------------- lines

    def _compute_lines(self) -> tuple[PlanLine, ...]:
        cfg = self.config
        fmt = self.kv_format.build()
        target_shape = CacheShape(self.num_pages, self.page_size, self.num_state_slots,
                                  staging_pages=self.num_staging_pages)
        staged = kv_layout(cfg, target_shape, fmt).total_bytes - HEADER_BYTES
        staging = (self.num_staging_pages * len(cfg.attention_layers)
                   * (fmt.staging_bytes_per_page(cfg.num_kv_heads, cfg.head_dim)
                      if self.num_staging_pages else 0))
        kv = staged - staging  # alignment padding stays here
        mtp_kv = kv_layout(cfg, self.cache_shape, fmt).total_bytes - HEADER_BYTES - staged
        per_slot = _state_bytes_per_slot(cfg)
        activations = self._activation_reserve()
        decode = self._decode_activations(self.live_slots)
        return (
            PlanLine("weights", self.weight_bytes - self.host_weight_bytes, self._weights_detail(),
                     "the weights alone do not fit: use 4-bit weights (--weights q4_k_m, or a "
                     "Q4_K_M GGUF / GPTQ int4 checkpoint), a smaller model, or raise "
                     "--gpu-memory-budget"),
            PlanLine("kv pages", kv,
                     f"{self.num_pages} pages x {self.page_size} tokens x "
                     f"{len(cfg.attention_layers)} layers",
                     f"lower --max-context-tokens (now {self.max_context_tokens}) or pick a "
                     "smaller --kv-format (rk4 is 4.5 bits per element)"),
            PlanLine("kv staging pages", staging,
                     f"{self.num_staging_pages} bf16 pages = {self.live_slots} live x "
                     f"({staging_per_sequence(fmt)} + {sink_pages(fmt)} cached sink)"
                     if self.num_staging_pages else "none (the format quantizes per token)",
                     f"lower --live-slots (now {self.live_slots}) or use a per-token "
                     "--kv-format (int8, rk4)"),
            PlanLine("mtp kv pages", mtp_kv,
                     f"{self.num_pages} pages x {self.page_size} tokens x {self.mtp_kv_layers} "
                     "MTP layers (speculative decoding)",
                     "use --speculative ngram (no MTP KV) or lower --max-context-tokens"),
            PlanLine("gdn live slots", self.live_slots * per_slot if cfg.is_hybrid else 0,
                     f"{self.live_slots if cfg.is_hybrid else 0} x {format_bytes(per_slot)}",
                     f"lower --live-slots (now {self.live_slots})"),
            PlanLine("gdn snapshot slots", self.snapshot_slots * per_slot if cfg.is_hybrid else 0,
                     f"{self.snapshot_slots if cfg.is_hybrid else 0} x {format_bytes(per_slot)}",
                     f"lower --snapshot-slots (now {self.snapshot_slots})"),
            PlanLine("gdn draft slots", self.num_draft_slots * per_slot,
                     f"{self.num_draft_slots} x {format_bytes(per_slot)} "
                     f"({self.draft_slots_per_sequence} per live sequence)",
                     "lower --draft-tokens or --live-slots"),
            PlanLine("activation reserve", activations,
                     f"estimate: prefill chunk {self.prefill_chunk_tokens} tokens"
                     + self._auto_chunk_note()
                     + (", GDN by fla-core's kernels" if self.gdn_prefill_kernel
                        and cfg.is_hybrid else "")
                     + (f", with a {format_bytes(self.weight_workspace_bytes)} slice of "
                        "dequantized weights" if self.weight_workspace_bytes else ""),
                     f"lower --prefill-chunk (now {self.prefill_chunk_tokens}) or "
                     "--max-context-tokens"),
            PlanLine("decode activations", decode,
                     f"estimate: {self.live_slots} x {self.verify_rows_per_sequence} rows",
                     f"lower --live-slots (now {self.live_slots})"),
            PlanLine("cuda graphs", self._graph_bytes(),
                     "estimate: a pool per captured batch size" if self.cuda_graphs else "none",
                     "run without CUDA graphs or lower --live-slots"),
            PlanLine("allocator slack",
                     SLACK_FIXED_BYTES + int(SLACK_ACTIVATION_FRACTION * (activations + decode)),
                     "256 MiB + 10% of activations",
                     "lower any line above or raise --gpu-memory-budget"),
            PlanLine("cuda contexts", self.cuda_processes * CUDA_CONTEXT_BYTES,
                     f"{self.cuda_processes} processes x {format_bytes(CUDA_CONTEXT_BYTES)} "
                     "(measured)",
                     "every GPU process holds a CUDA context: lower a line above (--prefill-chunk, "
                     "--snapshot-slots, --max-context-tokens) or raise --gpu-memory-budget"),
        )

    def _weights_detail(self) -> str:
        if not self.host_weight_bytes:
            return self.weight_format
        return (f"{self.weight_format}; the token table ({format_bytes(self.host_weight_bytes)}) "
                "in host memory")

    def _per_token_width(self) -> int:
        cfg = self.config
        q_width = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
        kv_width = cfg.num_kv_heads * cfg.head_dim
        conv = cfg.linear_conv_dim if cfg.is_hybrid else 0
        return (6 * cfg.hidden_size + 3 * cfg.intermediate_size + q_width + 2 * kv_width
                + 2 * conv)

    def _gdn_prefill_bytes_per_token(self) -> int:
        """The chunked delta rule's fp32 working set (engine/gdn.py): about 16
        [tokens, v_heads, head_dim] tensors live at once by count, 24 once
        calibrated on the 27B shape (NVML, prefill worker, chunks 512 and 2048).
        fla-core's kernels hold ~3.5 such tensors by their own allocations (the
        chunk states, the WY factors, the new values and the output, mostly
        bf16), plus the q/k norms and gates around them: 8. The 27B's prefill
        worker measured 528 / 668 / 788 MiB of PyTorch reserve at chunks of
        512 / 1,024 / 2,048 with fla (12-05, H100), under half of what the
        plan counts with 8."""
        cfg = self.config
        if not cfg.is_hybrid:
            return 0
        head = max(cfg.linear_k_head_dim, cfg.linear_v_head_dim)
        tensors = (GDN_PREFILL_KERNEL_FP32_TENSORS if self.gdn_prefill_kernel
                   else GDN_PREFILL_FP32_TENSORS)
        return tensors * cfg.linear_num_v_heads * head * 4

    def _decode_activations(self, batch: int) -> int:
        rows = max(batch, 1) * self.verify_rows_per_sequence
        return (rows * self._per_token_width() * self.activation_bytes
                + rows * self.config.vocab_size * 4)

    def _graph_bytes(self) -> int:
        if not self.cuda_graphs:
            return 0
        sizes, b = [], 1
        while b < self.live_slots:
            sizes.append(b)
            b *= 2
        sizes.append(self.live_slots)
        return 64 * MiB + sum(self._decode_activations(s) for s in sizes)

    def _dequantized_kv_bytes(self, context: int, kv_width: int) -> int:
        """One layer's K and V dequantized whole (the PyTorch path), or on the
        GPU the prefill's bf16 workspace (up to dense_prefill_max_tokens()) and
        one read slice's fp32 temporaries (~6 x 4 bytes per element, rk4p)."""
        if not self.paged_attention_kernel:
            return 2 * context * kv_width * self.activation_bytes
        if self.kv_format.name == "bf16":  # pages are read as they are
            return 0
        workspace = 2 * min(context, dense_prefill_max_tokens()) * kv_width * self.activation_bytes
        return workspace + min(context, DENSE_READ_SLICE_TOKENS) * kv_width * 24

    def _activation_reserve(self) -> int:
        cfg = self.config
        kv_width = cfg.num_kv_heads * cfg.head_dim
        context = min(self.max_context_tokens, cfg.max_position_embeddings)
        chunk = self.prefill_chunk_tokens * (self._per_token_width() * self.activation_bytes
                                             + self._gdn_prefill_bytes_per_token())
        dense_kv = self._dequantized_kv_bytes(context, kv_width)
        logits = max(self.live_slots, 1) * cfg.vocab_size * 4
        return chunk + dense_kv + self._split_partial_bytes() + logits + self.weight_workspace_bytes

    def _split_partial_bytes(self) -> int:
        """The fp32 partial outputs and log-sum-exps of a prefill chunk whose
        keys split (attention.prefill_key_splits; the kernel path only)."""
        if not self.paged_attention_kernel or not self.config.attention_layers:
            return 0
        cfg = self.config
        return (self.prefill_chunk_tokens * cfg.num_heads * PREFILL_KEY_SPLITS
                * (cfg.head_dim + 1) * 4)

    def _validate(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"capacity plan: {name} must be an int >= {minimum}, got {value!r}")

        for name in ("page_size", "max_context_tokens", "prefill_chunk_tokens",
                     "activation_bytes"):
            positive(name)
        for name in ("snapshot_slots", "weight_bytes", "draft_slots_per_sequence", "draft_tokens",
                     "mtp_kv_layers", "host_weight_bytes", "weight_workspace_bytes"):
            positive(name, 0)
        positive("live_slots", 1 if self.config.is_hybrid else 0)
        if self.host_weight_bytes > self.weight_bytes:
            raise ValueError("capacity plan: host_weight_bytes cannot exceed weight_bytes")
        if self.gpu_memory_budget is not None:
            positive("gpu_memory_budget")
        fmt = self.kv_format.build()  # unknown names and bad options raise here, not at start-up
        if fmt.uses_staging and self.live_slots < 1:
            raise ValueError(f"capacity plan: KV format {self.kv_format.name!r} keeps each live "
                             "sequence's open pages in staging pages: live_slots must be >= 1")


def _state_bytes_per_slot(cfg: ModelConfig) -> int:
    one = state_layout(cfg, 1).total_bytes - HEADER_BYTES
    zero = state_layout(cfg, 0).total_bytes - HEADER_BYTES
    return max(one - zero, 0)


def weight_bytes_of(config: ModelConfig, dtype: torch.dtype, weights: str = "bf16",
                    prefix: str = "") -> int:
    """Bytes of the model's parameters under a weight recipe (engine/quant/
    recipes.py; "bf16" = everything dense in `dtype`), counted on the meta
    device; only those whose names start with `prefix`, if given."""
    return weight_bytes_by_prefix(config, dtype, weights, (prefix,))[0]


def weight_bytes_by_prefix(config: ModelConfig, dtype: torch.dtype, weights,
                           prefixes: tuple[str, ...]) -> list[int]:
    """weight_bytes_of for several prefixes over one meta model; `weights` is a
    recipe name or a recipes.Chooser (a checkpoint's own formats)."""
    from engine.quant.recipes import recipe_weight_bytes

    model = _meta_model(config)
    return [recipe_weight_bytes(model, weights, dtype, prefix) for prefix in prefixes]


def _meta_model(config: ModelConfig):
    from engine.model import CausalLM

    with torch.device("meta"):
        return CausalLM(config)


def weight_counts(config: ModelConfig, dtype: torch.dtype, weights,
                  prefixes: tuple[str, ...]) -> tuple[list[int], int]:
    """weight_bytes_by_prefix, and the longest row among the matrices the
    recipe packs (recipes.widest_packed_in_features), over one meta model."""
    from engine.quant.recipes import recipe_weight_bytes, widest_packed_in_features

    model = _meta_model(config)
    return ([recipe_weight_bytes(model, weights, dtype, prefix) for prefix in prefixes],
            widest_packed_in_features(model, weights))


_UNITS = {"": 1, "b": 1,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


# The largest size parse_bytes accepts: far past any machine, and a float
# such as 1e400 (inf) or 1e30 stays an error rather than an OverflowError or
# a number no allocator or NVML figure can be compared with sensibly.
MAX_BYTES = 1 << 60  # 1 EiB


def parse_bytes(text: str | int) -> int:
    """'24GiB' -> 25769803776. KB/MB/GB/TB are powers of 1000; KiB/MiB/GiB/TiB
    and the bare K/M/G/T are powers of 1024 (as `free -g` and docker's -m read)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 24GiB, 512MiB, 20GB "
                         "or a number of bytes")
    size = float(m.group(1)) * _UNITS[unit]
    if not size <= MAX_BYTES:  # also inf (and nan, which no regex match gives)
        raise ValueError(f"{text!r} is too large for a size (at most 1 EiB): write e.g. "
                         "24GiB")
    return int(size)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
