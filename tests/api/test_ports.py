"""``ninfer.ports.free_ports``: consecutive ports, each bindable, never handed out twice."""
from __future__ import annotations

import socket

from ninfer import ports


def test_free_ports_are_consecutive_bindable_and_never_handed_out_twice():
    seen = set()
    for span in (1, 5, 12, 1, 3):
        base = ports.free_ports(span)
        got = set(range(base, base + span))
        assert ports.LOW <= base and base + span <= ports.HIGH
        assert not got & seen
        seen |= got
        socks = [socket.socket() for _ in got]
        try:
            for port, sock in zip(sorted(got), socks):
                sock.bind(("127.0.0.1", port))
        finally:
            for sock in socks:
                sock.close()


def test_a_taken_port_is_skipped():
    class Candidates:   # spans over a held port twice, then the ports past it
        def __init__(self, bases):
            self.bases = iter(bases)

        def randrange(self, lo, hi):
            return next(self.bases)

    held = socket.socket()
    held.bind(("127.0.0.1", 0))   # (an ephemeral port: free_ports never hands those out)
    taken = held.getsockname()[1]
    try:
        base = ports.free_ports(2, Candidates([taken - 1, taken, *range(taken + 1, taken + 99)]))
        assert base > taken
    finally:
        held.close()
