"""Asks one gRPC server whether it reports SERVING on the standard
`grpc.health.v1.Health` service, or one HTTP server (a target starting with
`http://`, such as the OpenAI gateway's `/health`) whether GET answers 200,
which counts as SERVING.

`python -m tandem.healthcheck TARGET` exits 0 iff TARGET is SERVING (compose
health checks run it); `HealthProbe` is the reusable form the supervisor polls.

Owns only the client side of grpc.health.v1 (and that HTTP GET). Must not know which process it
asks, what that process does, or how it was started.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# A server that is still starting refuses connections; gRPC's default
# reconnect backoff (1 s, growing) would then hide its first SERVING answer
# for seconds. Probes poll every ~50 ms, so reconnect at about that pace.
_FAST_RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
)


def as_target(address: str) -> str:
    """A gRPC target for ADDRESS: a bare filesystem path becomes `unix://PATH`;
    anything else (`unix:///x.sock`, `127.0.0.1:50051`) is already one."""
    return f"unix://{address}" if address.startswith("/") else address


class HealthProbe:
    """One channel to one server, asked repeatedly; close() when done."""

    def __init__(self, target: str, service: str = ""):
        self.target = as_target(target)
        self.service = service
        self._http = self.target.startswith(("http://", "https://"))
        self._channel = None if self._http else grpc.insecure_channel(self.target,
                                                                     options=_FAST_RECONNECT)
        self._stub = None if self._http else health_pb2_grpc.HealthStub(self._channel)

    def status(self, timeout_s: float = 1.0) -> str:
        """SERVING, NOT_SERVING, SERVICE_UNKNOWN, UNKNOWN, or the gRPC error
        code's name (e.g. UNAVAILABLE while nothing listens yet)."""
        if self._http:
            return _http_status(self.target, timeout_s)
        request = health_pb2.HealthCheckRequest(service=self.service)
        try:
            reply = self._stub.Check(request, timeout=timeout_s)
        except grpc.RpcError as e:
            return e.code().name if isinstance(e, grpc.Call) else "UNAVAILABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def serving(self, timeout_s: float = 1.0) -> bool:
        return self.status(timeout_s) == "SERVING"

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()

    def __enter__(self) -> "HealthProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _http_status(url: str, timeout_s: float) -> str:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return "SERVING" if reply.status == 200 else "NOT_SERVING"
    except urllib.error.HTTPError:
        return "NOT_SERVING"
    except (OSError, ValueError):  # refused, reset, timed out: nothing serves yet
        return "UNAVAILABLE"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.healthcheck",
        description="Exit 0 iff TARGET reports SERVING on grpc.health.v1.Health.")
    parser.add_argument("target", help="unix:///path.sock, /path.sock, host:port or http://host:port/health")
    parser.add_argument("--service", default="",
                        help="health service name (default: '', the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    with HealthProbe(args.target, args.service) as probe:
        status = probe.status(args.timeout)
    print(f"{probe.target}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
