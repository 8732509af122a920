"""What the public APIs (the router's gRPC edge and the OpenAI gateway) ask
of request text, in one place both import: the limits on stop strings and
the lone surrogate no tokenizer or UTF-8 response can carry. Plain
constants: the gateway imports it without torch or the router."""
from __future__ import annotations

import re

# Stop strings are matched on the router's event loop after every token, at a
# cost that grows with their number and length: 200,000 of them held every
# stream for seconds a token. These limits are far past what clients send
# (OpenAI takes 4) and keep a token's matching under a millisecond on average
# even for stop strings built to be slow (0.6 ms, 2-core CPU, 2026-12-05).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all stop strings together

# half of a UTF-16 surrogate pair: a JSON escape ("\ud800") may hold one
# alone, which json.loads keeps but no tokenizer (nor UTF-8) can encode
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
