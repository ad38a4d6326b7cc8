"""free_port: a port a stage can bind later, chosen where no process binding port 0 is handed it."""

from __future__ import annotations

import socket

from ovshard.runtime.wire.address import LOWEST, ephemeral_low, free_port


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    """Ray's workers and agents bind port 0 by the dozen while a cluster starts; a port drawn from the ephemeral
    range could be handed to one of them before the stage actor binds it (seen once: "Address already in use")."""
    low = ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert LOWEST <= port < low, (port, low)
        with socket.create_server(("127.0.0.1", port)):
            pass
