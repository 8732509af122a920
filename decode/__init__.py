"""The decode worker: continuous batching over sequences whose KV lives in the
shared store, per-request sampling, MTP speculative decoding, token streaming.

Must not know about the public API, text, or the radix tree's policy.
"""
