"""Which drafter and how many draft tokens; validated on creation."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.errors import InvalidRequestError

METHODS = ("none", "mtp", "ngram")
MAX_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "none", "mtp" (the model's MTP head, shipped or trained with
    `tandem train-mtp`) or "ngram" (prompt lookup, no weights).
    num_draft_tokens: k in 1..4, draft tokens verified per step.
    ngram_max/ngram_min: longest and shortest suffix the n-gram drafter looks up."""

    method: str = "none"
    num_draft_tokens: int = 3
    ngram_max: int = 4
    ngram_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"unknown speculative method {self.method!r}: use one of "
                                      f"{', '.join(METHODS)}")
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(f"draft tokens must be an integer in 1..{MAX_DRAFT_TOKENS}, "
                                      f"got {k!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError(f"n-gram sizes must satisfy 1 <= ngram_min <= ngram_max, "
                                      f"got {self.ngram_min}..{self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def uses_mtp(self) -> bool:
        return self.method == "mtp"

    def spare_slots(self, config: ModelConfig) -> int:
        """Extra GDN state slots one running sequence needs: one per draft
        position (the state after each verified token; the sequence's own slot
        takes the first). Dense models keep no recurrent state: none."""
        return self.num_draft_tokens if self.enabled and config.is_hybrid else 0

    def mtp_kv_layers(self, config: ModelConfig) -> int:
        """MTP layers that need a KV page pool."""
        return config.mtp_num_layers if self.uses_mtp else 0

    def check_model(self, config: ModelConfig) -> None:
        if self.uses_mtp and not config.mtp_num_layers:
            raise InvalidRequestError(
                "--speculative mtp needs an MTP head, and this model has none: train one with "
                "`tandem train-mtp` (the head file is found beside the weights), or use "
                "--speculative ngram")
