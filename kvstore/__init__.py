"""The shared KV store: page pool and GDN state slots, KV formats, the radix
prefix cache, and the long-lived process that owns them (and the weights).

Owns which page belongs to whom. Must not know about sampling, requests'
text, or the public API; it never runs a model forward.
"""
