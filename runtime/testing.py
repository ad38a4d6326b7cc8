"""Helpers for tests of the runtime; the library and the CLI never import this module."""

from __future__ import annotations

from ovshard.runtime.wire.address import free_port

__all__ = ["free_port"]
