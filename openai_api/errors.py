"""OpenAI's error object and the HTTP status of each failure.

Every error leaves the gateway as `{"error": {"message", "type", "param",
"code"}}`; a gRPC status from the router becomes the HTTP status a client of
OpenAI's API expects for the same kind of failure."""
from __future__ import annotations

import grpc


class ApiError(Exception):
    """A failure to report to the client as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(param: str | None, message: str) -> ApiError:
    """A bad request parameter: 400, naming the parameter."""
    return ApiError(400, message, "invalid_request_error", param, "invalid_value" if param else None)


# gRPC status of the router -> (HTTP status, OpenAI error type, code)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error", None),
    # no KV capacity right now: a retry later succeeds, as after a rate limit
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "no_capacity"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "timeout"),
}


def from_grpc(error: grpc.aio.AioRpcError) -> ApiError:
    status, type_, code = _STATUS.get(error.code(), (500, "server_error", None))
    message = error.details() or error.code().name
    if error.code() == grpc.StatusCode.UNAVAILABLE and "connect" in message.lower():
        message = f"the tandem router is unreachable ({message}); retry shortly"
    return ApiError(status, message, type_, None, code)
