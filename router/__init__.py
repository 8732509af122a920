"""The router: public gRPC (and HTTP) API, tokenization, chat templates, and the
orchestration of one request through kvstore -> prefill -> decode.

Must not run model compute or touch KV memory directly.
"""
