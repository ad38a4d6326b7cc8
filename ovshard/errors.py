"""The error hierarchy. Every message says what was expected, what was found, and what to do."""

from __future__ import annotations

from pathlib import Path


class OvshardError(Exception):
    """Base of every error ovshard raises on purpose; the CLI prints these without a traceback."""


class StageFailure(OvshardError):
    """A stage reported an error for a step or a tick, or its connection failed; ``recoverable``: reconnect (or
    start the sequence again) and replay."""

    def __init__(self, message: str, recoverable: bool) -> None:
        super().__init__(message)
        self.recoverable = recoverable


class ConfigError(OvshardError, ValueError):
    """A setting (a command-line option or the config field it fills) is outside the values it accepts.

    Also a ValueError, so decoders that turn a bad field into a BundleError (bundle/schema.py) keep doing so.
    """


class CheckpointError(OvshardError):
    """The Hugging Face checkpoint is missing, unreadable, or inconsistent."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's model_type (or one of its settings) has no entry in the architecture table."""


class PlanError(OvshardError):
    """No partition of the layers into stages satisfies the request."""


class PassError(OvshardError):
    """A graph pass failed: its precondition was unmet, its promise broken, or it raised."""


class PreconditionError(PassError):
    """A pass's ``requires`` found the graph lacking a fact the pass needs (a pass ordering problem)."""


class PostconditionError(PassError):
    """A pass (or a validating instrument after it) left the graph without a fact it promised."""


class BundleError(OvshardError):
    """A bundle cannot be written, or one on disk is missing files or fails its checksums."""


class DiskFullError(BundleError):
    """The file system filled up while a bundle (or a file for it) was written; what was written is removed.

    ``path`` is the file whose write failed, where known; the message names it, the space needed and the space free.
    """

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[type[DiskFullError], tuple[str, Path | None]]:
        return type(self), (str(self), self.path)  # survives a worker process (--jobs)


class PagedUnsupportedError(BundleError):
    """A stage the paged-attention conversion cannot take (or take exactly): run it on the stateful path."""


class CredentialsError(OvshardError):
    """TLS credentials are missing, unsafe or inconsistent, or a peer refused (or was refused in) a handshake."""
