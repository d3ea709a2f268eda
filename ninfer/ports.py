"""Free TCP ports on 127.0.0.1 for the processes a test or benchmark starts (servers, fleets,
llama.cpp's server)."""
from __future__ import annotations

import random
import socket

# below Linux's default ephemeral range (32768-60999), where an outgoing connection could take a
# port between this check and the server's bind
LOW, HIGH = 20000, 32768

_handed_out: set[int] = set()


def free_ports(span: int = 1, rng=random) -> int:
    """The first of ``span`` consecutive ports free on 127.0.0.1 (a fleet takes ``base + i``),
    all bound at once while checked (ports bound and released one at a time can come back the
    same) and never handed out before by this process; ``rng.randrange`` picks the candidates.

    Raises:
        RuntimeError: no such span found in 1,000 tries.
    """
    for _ in range(1000):
        base = rng.randrange(LOW, HIGH - span)
        ports = range(base, base + span)
        if _handed_out.intersection(ports):
            continue
        socks = [socket.socket() for _ in ports]
        try:
            for port, sock in zip(ports, socks):
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        _handed_out.update(ports)
        return base
    raise RuntimeError(f"no {span} consecutive free ports in {LOW}..{HIGH - 1}")
