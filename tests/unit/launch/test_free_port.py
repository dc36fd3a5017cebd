""":func:`hpc_elastic.launch.workers.free_port`: a rendezvous port outside the kernel's ephemeral range, which an
outgoing connection cannot be given before rank 0 listens on it; a port some socket holds is never returned."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

from hpc_elastic.launch.workers import DEFAULT_EPHEMERAL, LOWEST_PORT, ephemeral_ports, free_port


class Draws(random.Random):
    """Returns the given ports in turn from ``randrange``."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__(0)
        self.ports = ports
        self.asked: list[tuple[int, int]] = []

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:
        assert stop is not None
        self.asked.append((start, stop))
        return self.ports.pop(0)


def held_port() -> tuple[socket.socket, int]:
    """A listening socket on a port below the ephemeral range (the caller closes it)."""
    low, _ = ephemeral_ports()
    for port in random.Random(3).sample(range(LOWEST_PORT, low), 200):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("", port))
        except OSError:
            sock.close()
            continue
        sock.listen()
        return sock, port
    raise AssertionError("no port below the ephemeral range could be bound")


def test_the_port_is_drawn_below_the_ephemeral_range_and_bindable() -> None:
    low, _ = ephemeral_ports()
    port = free_port()
    assert LOWEST_PORT <= port < low
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("", port))


def test_a_held_port_is_skipped() -> None:
    sock, held = held_port()
    with sock:
        draws = Draws([held, held + 1 if held + 1 < ephemeral_ports()[0] else held - 1])
        port = free_port(draws)
        assert port != held and draws.ports == [] and len(draws.asked) == 2
        assert draws.asked[0] == (LOWEST_PORT, ephemeral_ports()[0])


def test_without_room_below_the_range_the_kernel_chooses() -> None:
    draws = Draws([])
    port = free_port(draws, ephemeral=(1024, 65535))
    assert draws.asked == [] and 1 <= port <= 65535


def test_the_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    good = tmp_path / "range"
    good.write_text("40000\t50000\n")
    assert ephemeral_ports(good) == (40000, 50000)
    bad = tmp_path / "bad"
    bad.write_text("not a range\n")
    assert ephemeral_ports(bad) == DEFAULT_EPHEMERAL
    assert ephemeral_ports(tmp_path / "missing") == DEFAULT_EPHEMERAL
