"""The prefill worker: runs the uncached suffix of a prompt in bounded chunks and
writes KV pages and hybrid-state snapshots straight into the shared store.

Must not know about the public API, text, or the radix tree's policy.
"""
