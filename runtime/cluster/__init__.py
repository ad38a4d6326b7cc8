"""The cluster launcher: ovshard up on Ray (probe, place, ship stage files, start and supervise workers)."""
