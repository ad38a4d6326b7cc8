"""The error hierarchy. Every message says what was expected, what was found, and what to do."""

from __future__ import annotations


class OvshardError(Exception):
    """Base of every error ovshard raises on purpose; the CLI prints these without a traceback."""


class CheckpointError(OvshardError):
    """The Hugging Face checkpoint is missing, unreadable, or inconsistent."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's model_type (or one of its settings) has no entry in the architecture table."""


class PlanError(OvshardError):
    """No partition of the layers into stages satisfies the request."""


class PassError(OvshardError):
    """A graph pass found a precondition unmet, or left the graph invalid."""


class BundleError(OvshardError):
    """A bundle cannot be written, or one on disk is missing files or fails its checksums."""
