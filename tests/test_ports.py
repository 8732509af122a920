"""tandem.ports: listeners' ports come from below the kernel's ephemeral
range, where no outgoing connection's local port can take them before the
listener binds (the disaggregated router's did, in CI, 12-07)."""
import socket

import pytest

from tandem import ports


def test_a_port_is_free_and_below_the_ephemeral_range():
    floor = ports.ephemeral_floor()
    seen = set()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < floor
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))   # still free: nothing holds it
        seen.add(port)
    assert len(seen) > 1   # drawn, not one fixed port every service would share


def test_the_ephemeral_floor_is_the_kernels(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", ranges)
    assert ports.ephemeral_floor() == 40000
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_floor() == ports.LINUX_EPHEMERAL


def test_no_room_below_the_range_takes_the_kernels_choice(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text(f"{ports.LOWEST + 10}\t60999\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", ranges)
    assert 0 < ports.free_port() < 65536


def test_a_port_in_use_is_skipped(monkeypatch):
    """Every draw but the last lands on a port a listener holds."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        free = ports.free_port()
        draws = iter([taken] * 5 + [free])
        monkeypatch.setattr(ports.random.Random, "randrange", lambda self, a, b: next(draws))
        assert ports.free_port() == free


def test_every_draw_in_use_is_an_error(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports.random.Random, "randrange", lambda self, a, b: taken)
        with pytest.raises(OSError, match="no free port"):
            ports.free_port(tries=3)
