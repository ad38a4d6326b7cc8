"""The wire both ends share: typed messages, framing, the transport and its handshake, mutual TLS."""
