"""The OpenAI-compatible HTTP gateway: `/v1/chat/completions`,
`/v1/completions` and `/v1/models` for agent frameworks and the official
clients, served by aiohttp in a process of its own.

    python -m openai_api --router 127.0.0.1:50051 --host 127.0.0.1 --port 8000 [--api-key KEY]

Owns the translation between OpenAI's JSON (requests, responses, server-sent
event chunks, error objects) and tandem's public gRPC API `tandem.v1`
(Generate, Abort, Tokenize, GetModelInfo), which it reaches over one grpc.aio
channel like any other client; parsing Qwen-style `<tool_call>` text into
OpenAI `tool_calls`; the optional bearer API key.

Must not know KV pages, workers, the prefix cache's workings or model
compute: everything it learns comes from `tandem.v1` messages (so it never
imports engine/, kvstore/ or router/).

Modules: `errors` (OpenAI error JSON, gRPC status -> HTTP status),
`protocol` (request JSON -> GenerateRequest; events -> response JSON),
`tools` (tool-call parsing, whole and streaming), `app` (routes, auth,
streaming, disconnects), `__main__` (the command line).
"""
