"""How a bundle stores its weights: the one description of a weight format."""

from __future__ import annotations

from dataclasses import dataclass

from ovshard.errors import ConfigError

WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4_sym", "int4_asym")


@dataclass(frozen=True)
class WeightFormat:
    """A weight format; kept in the manifest.

    ``group_size``, ``ratio`` and ``all_layers`` matter for the INT4 modes only (``all_layers`` for
    int8 too: NNCF's INT8 is per channel and always covers every layer).
    """

    mode: str = "int4_asym"
    group_size: int = 128
    ratio: float = 1.0
    all_layers: bool = False

    def __post_init__(self) -> None:
        if self.mode not in WEIGHT_FORMATS:
            raise ConfigError(f"--weights {self.mode!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
        if self.group_size < -1 or self.group_size == 0:
            # NNCF (GroupSizeFallbackMode.ADJUST) gives a layer whose input channels the size does not divide
            # the largest power of two that does divide them, or INT8 when that is below 32
            raise ConfigError(f"--group-size {self.group_size}: expected a positive INT4 group size, e.g. 128 "
                              "(ideally one that divides the hidden size: a layer it does not divide gets a "
                              "smaller power of two, or INT8), or -1 for one scale per output channel")
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError(f"--ratio {self.ratio}: expected the share of weights in INT4, from 0 to 1")

    @property
    def is_int4(self) -> bool:
        return self.mode.startswith("int4")

    def describe(self) -> str:
        """``mode=int4_asym, group_size=128, ratio=1.0, all_layers=False``, only the fields that matter."""
        shown = {"mode": self.mode}
        if self.mode == "int8":
            shown["all_layers"] = str(self.all_layers)
        elif self.is_int4:
            shown.update(group_size=str(self.group_size), ratio=str(self.ratio), all_layers=str(self.all_layers))
        return ", ".join(f"{k}={v}" for k, v in shown.items())
