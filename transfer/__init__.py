"""Moving a request's KV pages and hybrid state between two KV stores, for
the disaggregated topology (prefill and decode on their own devices, each
device with its own store).

Owns: the raw page and slot buffers of a store's arenas grouped by layer
(`pages.py`, format-agnostic bytes), the torch.distributed process group over
all transfer endpoints (`group.py`: gloo on the CPU, NCCL on CUDA), the
prefill side's outgoing transfers (`outbox.py`: per-chunk pushes, over the
group or as peer copies into a mapped peer store) and the decode side's
incoming ones (`inbox.py`). Must not know requests, routing, the prefix cache
or the model: callers name pages and slots by id."""
