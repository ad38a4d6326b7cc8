"""How a bundle stores its weights: the one description of a weight format."""

from __future__ import annotations

from dataclasses import dataclass

from ovshard.errors import ConfigError

# int4_affine: asymmetric INT4 whose zero point is an f16 per group, not a 4-bit integer (llama.cpp's Q4_1 in
# groups of 32: codes, a scale and an offset); data-free min-max, which a Q4_0 or Q4_1 source's blocks it matches
WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4_sym", "int4_asym", "int4_affine")
MIN_INT4_GROUP = 32  # NNCF's ADJUST fallback: below this power-of-two group a weight is stored in INT8
MIN_TABLE_GROUP = 8  # an INT4 embedding's groups (--embedding-group-size), which ovshard writes itself when fitted
OWN_FIT = "scale_fit"  # ovshard's own scale fit of symmetric INT4 (ovshard.frontend.int4_fit), alone
NNCF_DATA_AWARE = ("awq", "scale_estimation", "gptq", "lora_correction")  # NNCF's methods that need calibration text
DATA_AWARE = (*NNCF_DATA_AWARE, OWN_FIT)
# ovshard's own scale fit: NNCF's scale estimation's accuracy or better at a fraction of its cost
# (docs/results/2026-12-int4-fit.md); NNCF's scale estimation for int4_asym, which the fit does not cover
DEFAULT_DATA_AWARE = (OWN_FIT,)
DEFAULT_DATA_AWARE_ASYM = ("scale_estimation",)
# the embedding and lm_head beside INT4 decoder weights: INT8 per channel, or INT4 in groups of ``embedding_group``
# (in a calibrated compile fitted to the lm_head's inputs, the final hidden states: ovshard.frontend.int4_fit)
TABLE_FORMATS = ("int8", "int4_sym", "int4_asym")


@dataclass(frozen=True)
class WeightFormat:
    """A weight format; kept in the manifest.

    ``group_size``, ``ratio``, ``budget`` and ``int8_weights`` matter for the INT4 modes only
    (``all_layers`` for int8 too: NNCF's INT8 is per channel and always covers every layer).

    INT4 keeps the embedding and the lm_head in INT8 (unless ``all_layers``), and the decoder weights that
    INT4 hurts most in INT8 too, chosen for the whole model (``ovshard.plan.precision``): most sensitive
    first while the bundle stays within ``budget`` times its all-INT4 size (a mixture of experts: also what a
    decode step reads, the routed experts counted) and at least ``ratio`` of the decoder's weights stay INT4. ``int8_weights`` is that choice (``"layer.projection"`` keys, e.g.
    ``"3.down"``), made by the compiler and recorded so that every stage and every part of a bundle
    applies the same one. Default: int4_sym, group 128, budget 1.15, with ovshard's own scale fit on the shipped
    text where the compile can (``ovshard.compile``; docs/results/2026-12-int4-fit.md).
    """

    mode: str = "int4_sym"
    group_size: int = 128
    ratio: float = 0.0
    all_layers: bool = False
    budget: float = 1.15
    int8_weights: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()  # NNCF's data-aware methods on the INT4 weights, layer by layer (DATA_AWARE)
    calibration: str = "none"  # where their text came from: "none", "auto", "text" or "file NAME"
    calibration_digest: str = ""  # sha256 of the calibration token ids (ovshard.frontend.calibration.CalibrationText)
    embedding: str = "int8"  # the embedding and lm_head beside INT4 decoder weights (TABLE_FORMATS), unless all_layers
    embedding_group: int = 32  # its INT4 group size

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
            raise ConfigError(f"--ratio {self.ratio}: expected the least share of decoder weights kept in INT4, "
                              "from 0 to 1 (1: every decoder weight INT4)")
        if not 1.0 <= self.budget <= 4.0:
            raise ConfigError(f"--budget {self.budget}: expected the most bundle size, as a multiple of the "
                              "all-INT4 size, that INT8 copies of sensitive weights may take: from 1.0 (none) "
                              "to 4.0, e.g. 1.15")
        unknown = [m for m in self.methods if m not in DATA_AWARE]
        if unknown:
            raise ConfigError(f"--calibration-methods {','.join(unknown)}: expected some of {', '.join(DATA_AWARE)}")
        if OWN_FIT in self.methods and (self.mode != "int4_sym" or len(self.methods) > 1):
            raise ConfigError(f"--calibration-methods {','.join(self.methods)} with --weights {self.mode}: {OWN_FIT} "
                              "fits symmetric INT4 and runs alone; use --weights int4_sym with it, or NNCF's "
                              "methods (e.g. scale_estimation) instead")
        if self.embedding not in TABLE_FORMATS:
            raise ConfigError(f"--embedding {self.embedding!r}: expected one of {', '.join(TABLE_FORMATS)}")
        if self.embedding_group < MIN_TABLE_GROUP or self.embedding_group & (self.embedding_group - 1):
            raise ConfigError(f"--embedding-group-size {self.embedding_group}: expected a power of two of at least "
                              f"{MIN_TABLE_GROUP}, e.g. 32")
        if self.methods and self.mode == "int4_affine":
            raise ConfigError(f"--calibration-methods {','.join(self.methods)} with --weights int4_affine: its groups "
                              "are data-free min-max; use --calibration none, or --weights int4_sym or int4_asym")
        if self.methods and not self.is_int4:
            raise ConfigError(f"--calibration calibrates INT4 weights; --weights {self.mode} has none: use "
                              "--weights int4_sym or int4_asym, or --calibration none")

    @property
    def is_int4(self) -> bool:
        return self.mode.startswith("int4")

    @property
    def table(self) -> WeightFormat | None:
        """The embedding's and lm_head's INT4 format where it differs from the decoder's: None where they stay INT8
        (the default) or follow the decoder's format (``all_layers``, or no INT4 at all)."""
        if not self.is_int4 or self.all_layers or self.embedding == "int8":
            return None
        return WeightFormat(self.embedding, self.embedding_group, ratio=1.0, all_layers=True, budget=1.0)

    def group_for(self, in_features: int) -> int | None:
        """The INT4 group NNCF uses over ``in_features`` inputs, or None where it stores the weight in INT8.

        NNCF's ADJUST fallback: where the group size does not divide the inputs, the largest power of two
        below it that does, or INT8 when that is under 32.
        """
        if self.mode == "int8":
            return None
        if self.group_size == -1:
            return in_features
        if in_features % self.group_size == 0:
            return self.group_size
        group = in_features & -in_features  # the largest power of two dividing in_features
        while group > self.group_size:
            group //= 2
        return group if group >= MIN_INT4_GROUP else None

    def describe(self) -> str:
        """``mode=int4_sym, group_size=128, ratio=0.0, budget=1.15, all_layers=False, int8_weights=12``, only
        the fields that matter."""
        shown = {"mode": self.mode}
        if self.mode == "int8":
            shown["all_layers"] = str(self.all_layers)
        elif self.is_int4:
            shown.update(group_size=str(self.group_size), ratio=str(self.ratio), budget=str(self.budget),
                         all_layers=str(self.all_layers), int8_weights=str(len(self.int8_weights)))
            if self.table is not None:
                shown.update(embedding=f"{self.embedding} g{self.embedding_group}")
            if self.methods:
                shown.update(methods="+".join(self.methods), calibration=self.calibration)
        return ", ".join(f"{k}={v}" for k, v in shown.items())
