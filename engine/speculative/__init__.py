"""Speculative decoding: draft a few tokens cheaply, verify them with one
forward of the target model, keep the longest prefix the target agrees with.

Owns the speculative configuration (`SpeculativeConfig`), the drafters (the
model's MTP head, `mtp.py`; prompt lookup, `ngram.py`), the acceptance rules
(greedy exact match and rejection sampling, `acceptance.py`) and the
verify/commit/draft cycle over the paged interface (`decoder.py`), shared by
the offline engine and the decode worker.

Must not know processes, gRPC, who owns a page or slot (it is handed the
sequence's pages and its spare GDN slots), nor text.
"""
from engine.speculative.config import MAX_DRAFT_TOKENS, METHODS, SpeculativeConfig
from engine.speculative.decoder import SpecState, SpeculativeDecoder, Verified

__all__ = ["MAX_DRAFT_TOKENS", "METHODS", "SpeculativeConfig", "SpecState", "SpeculativeDecoder",
           "Verified"]
