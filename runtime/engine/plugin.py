"""The OpenVINO properties a stage compiles with, and where each comes from.

On CPU three layers, each winning over the one before key by key: the bundle's hints for every CPU
(``runtime_hints.cpu_plugin``), the bundle's hints for this CPU's instruction-set class
(``runtime_hints.cpu_plugin_by_isa``, the class from ``engine/cpu.py``), and the caller's own settings
(--exact, --threads). On any other device the caller's settings alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ovshard.bundle.manifest import Manifest
from ovshard.runtime.engine.cpu import ISA_ENV, check_isa, cpu_name, forced_isa, isa_class

__all__ = ["PluginSettings", "describe_plugin_config", "plugin_config", "plugin_settings"]

CALLER = "the node's settings (--exact, --threads)"


@dataclass(frozen=True)
class PluginSettings:
    """A stage's plugin properties as layers, lowest first: (where they come from, properties)."""

    device: str
    isa: str | None  # the CPU's ISA class; None off CPU
    layers: tuple[tuple[str, dict[str, str]], ...]
    forced: bool = False  # the class is OVSHARD_CPU_ISA's, not the CPU's own

    @property
    def config(self) -> dict[str, str]:
        """The properties to compile with: every layer merged, a later one winning key by key."""
        merged: dict[str, str] = {}
        for _, properties in self.layers:
            merged.update(properties)
        return merged

    def describe(self, cpu: str) -> str:
        """One line: the device (on CPU its name ``cpu`` and ISA class), then each property that applies,
        grouped by the layer it comes from."""
        winner = {key: i for i, (_, properties) in enumerate(self.layers) for key in properties}
        groups = []
        for i, (source, properties) in enumerate(self.layers):
            shown = [f"{key}={value}" for key, value in properties.items() if winner[key] == i]
            if shown:
                groups.append(f"{', '.join(shown)} from {source}")
        said = "; ".join(groups) or "the plugin's own defaults"
        if self.isa is None:
            return f"{self.device}: {said}"
        forced = f" from {ISA_ENV}" if self.forced else ""
        none = "" if self.layers[1][1] else ", no hints for it in the bundle"
        return f"CPU {cpu!r} (ISA class {self.isa}{forced}{none}): {said}"


def plugin_settings(manifest: Manifest, device: str, config: dict[str, str] | None,
                    isa: str | None = None) -> PluginSettings:
    """The layers of a stage's properties on ``device`` (``isa``: the CPU's class, default ``isa_class()``)."""
    caller = (CALLER, dict(config or {}))
    if device.upper() != "CPU":
        return PluginSettings(device, None, (caller,))
    forced = isa is None and forced_isa() is not None
    isa = isa_class() if isa is None else check_isa(isa, f"ISA class {isa!r}")
    hints = manifest.runtime_hints
    return PluginSettings(device, isa, (("the bundle's hints", dict(hints.cpu_plugin)),
                                        (f"the bundle's hints for {isa}", dict(hints.cpu_plugin_by_isa.get(isa, {}))),
                                        caller), forced)


def plugin_config(manifest: Manifest, device: str, config: dict[str, str] | None,
                  isa: str | None = None) -> dict[str, str]:
    """The properties a stage compiles with: on CPU the manifest's measured defaults (``cpu_plugin``), then
    its hints for the CPU's ISA class (``cpu_plugin_by_isa``; ``isa`` default ``isa_class()``), then the
    caller's ``config`` (--exact, --threads), each winning over the one before key by key."""
    return plugin_settings(manifest, device, config, isa).config


def describe_plugin_config(manifest: Manifest, device: str = "CPU", config: dict[str, str] | None = None,
                           isa: str | None = None) -> str:
    """What a stage on ``device`` compiles with and why, in one line for the log, e.g. ``CPU 'Intel(R) Xeon(R)
    ...' (ISA class avx512_amx): PERFORMANCE_HINT=LATENCY from the bundle's hints; INFERENCE_PRECISION_HINT=f32
    from the bundle's hints for avx512_amx``."""
    return plugin_settings(manifest, device, config, isa).describe(cpu_name())
