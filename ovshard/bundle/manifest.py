"""The bundle contract: ``manifest.json`` as frozen dataclasses, and reading a bundle back.

This module imports only the standard library: the runtime reads manifests on nodes that have no
torch, transformers or nncf.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ovshard.bundle import names, schema
from ovshard.bundle.checked import CheckedFiles
from ovshard.bundle.dims import ModelDims
from ovshard.bundle.kv_store import KVStore, kv_store
from ovshard.bundle.plan import PartitionPlan
from ovshard.bundle.stage import OfStage, StageSpec, check_tiling
from ovshard.bundle.weights import WeightFormat
from ovshard.errors import BundleError

FORMAT_NAME = "ovshard-bundle"
FORMAT_VERSION = 2  # 2: typed manifest (nested stage specs, typed hints); 1 was read by string keys


@dataclass(frozen=True)
class TensorSpec:
    name: str
    element_type: str  # OpenVINO type name: "i64", "f32", ...
    shape: str  # partial shape, e.g. "[?,?,64]"

    @classmethod
    def of_ports(cls, ports: Sequence[Any]) -> tuple[TensorSpec, ...]:
        """The specs of OpenVINO ports (a saved model's inputs or outputs, as its reader names them)."""
        return tuple(cls(p.get_any_name(), p.get_element_type().get_type_name(), str(p.get_partial_shape()))
                     for p in ports)


@dataclass(frozen=True)
class StageEntry(OfStage):
    """One stage's files, I/O and state, as written."""

    stage: StageSpec
    model_xml: str
    model_bin: str
    sha256: dict[str, str]  # file name -> hex digest, for model_xml and model_bin
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    state_variables: tuple[str, ...]


@dataclass(frozen=True)
class Source:
    """The checkpoint a bundle was compiled from."""

    path: str
    fingerprint: str  # "sha256:..." over config.json and the safetensors headers
    model_type: str
    frontend: str  # "torchscript" | "onnx"
    quantization: str | None = None  # the source's own quantization (a GGUF file type, e.g. "Q4_K_M"); None: float


@dataclass(frozen=True)
class PassRecord:
    """One line of the pass log: a pass run on a stage."""

    stage: int
    name: str
    modified: bool
    seconds: float


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer: str
    detokenizer: str
    sha256: dict[str, str]


@dataclass(frozen=True)
class Generation:
    """Token ids generation needs, from generation_config.json (or config.json)."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def start_ids(self) -> list[int]:
        """What to feed when there is no prompt: BOS, or token 1 when the model has none."""
        return [self.bos_token_id if self.bos_token_id is not None else 1]


@dataclass(frozen=True)
class Chat:
    """The checkpoint's chat template, the special tokens it reads, and the tokens that end a turn.

    The templates are files of the bundle (``chat_template.jinja`` and ``chat_template.<name>.jinja``);
    the tokenizer IR carries the default one too, as rt_info ``chat_template``, where openvino-genai reads it.
    """

    template: str  # file of the default template: chat_template.jinja
    named: dict[str, str]  # the checkpoint's other templates: name -> file, e.g. "tool_use" -> chat_template.tool_use.jinja
    sha256: dict[str, str]  # every template file -> hex digest
    special_tokens: dict[str, str]  # the variables the template reads: "bos_token" -> "<bos>", "eos_token" ...
    # The special token the template writes right after an assistant message ("<|im_end|>", "<end_of_turn>"):
    # generation stops there as on generation.eos_token_ids. Empty when it writes none (or only an eos).
    end_of_turn_ids: tuple[int, ...]


# The CPU plugin properties a stage runs with unless the user sets others (--exact, --threads), chosen by
# bench/against_llama_cpp/decode_overhead.py --part settings (docs/results/2026-12-against-llama-cpp.md): on the real Gemma 3
# 270M's default compile no setting tried beat these beyond the run-to-run noise (+-15%), and the others lost
# clearly (THROUGHPUT 0.60-0.67x, no dynamic quantization 0.73-0.95x, one thread of two 0.61-0.68x). They are
# OpenVINO 2026.4's own CPU defaults, written down so a bundle keeps them where a plugin's defaults differ.
# INFERENCE_PRECISION_HINT is left to the plugin: bf16 where the CPU has AVX512-BF16 or AMX (on that 2-core EPYC,
# OpenVINO 2026.4.1 compiles stories260K's stages, fp32 and INT4, at bf16), f32 elsewhere.
CPU_PLUGIN_HINTS = {"PERFORMANCE_HINT": "LATENCY", "KV_CACHE_PRECISION": "u8", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}
CPU_PLUGIN_MEASURED = ("bench/against_llama_cpp/decode_overhead.py --part settings, Gemma 3 270M default compile, 2 cores (AVX512-BF16, "
                       "no AMX), OpenVINO 2026.4.1: none faster beyond noise; THROUGHPUT 0.60-0.67x, dynamic "
                       "quantization off 0.73-0.95x")

# The instruction-set classes a node's CPU falls in, most capable first: the keys of the per-class hints below.
# ovshard.runtime.engine.cpu tells them apart (avx512_amx: AMX tiles with int8 and bf16 on AVX-512; avx512:
# AVX-512 F, BW, VL and DQ; avx2: AVX2 and FMA); "other" is every other CPU, which gets cpu_plugin alone.
CPU_ISA_CLASSES = ("avx512_amx", "avx512", "avx2", "other")

# CPU plugin properties per ISA class, layered over CPU_PLUGIN_HINTS on a node of that class (the user's settings
# still win). The fastest settings differ by instruction set: dynamic quantization of activations
# (DYNAMIC_QUANTIZATION_GROUP_SIZE) works only where INFERENCE_PRECISION_HINT is f32, and the plugin picks bf16
# where the CPU has AVX512-BF16 or AMX. One line a class here, and its measurement on its line below.
CPU_PLUGIN_HINTS_BY_ISA: dict[str, dict[str, str]] = {
    "avx512_amx": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "128"},
    "avx512": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"},
    "avx2": {},
}
CPU_PLUGIN_BY_ISA_MEASURED: dict[str, str] = {
    "avx512_amx": ("bench/device/paper.py settings, 16-core Intel Xeon (AMX), OpenVINO 2026.4.1, data-free default "
                   "compiles of the Llama-3.2-1B and 3.1-8B shapes: a decode step 1.83x/1.64x/1.54x faster than the "
                   "plugin's bf16 at 2/4/8 threads (1B), 1.79x/1.60x at 4/8 (8B), group 32 within 5% of 128; "
                   "dynamic quantization needs f32 compute (docs/results/2026-12-one-node.md)"),
    "avx512": ("bench/device/tuning.py settings, 2-core AMD EPYC (AVX512-BF16, no AMX), OpenVINO 2026.4.1: a decode "
               "step 1.08x faster than the plugin's bf16 on the Llama-3.2-1B shape and SmolLM2-135M at 2 threads "
               "(group 128: 1.03-1.06x, 0.82x on 576-wide rows at 1 thread); a 512-token prompt 1.05x slower"),
    "avx2": ("the plugin's f32 default and the base hints (dynamic quantization in groups of 32), measured with "
             "oneDNN capped at AVX2 with VNNI (ONEDNN_MAX_CPU_ISA=AVX2_VNNI) on a 2-core Intel Xeon, OpenVINO "
             "2026.4.1: a decode step of the Llama-3.2-1B shape 2x and of SmolLM2-135M's Q4_0 file 1.38x faster "
             "than without it, groups of 128 within 5% of 32; a CPU without VNNI runs without it whatever the hint "
             "(docs/results/2026-12-one-node.md)"),
}


DQ_GROUP = "DYNAMIC_QUANTIZATION_GROUP_SIZE"
MIN_DQ_GROUP = 16  # the CPU plugin quantizes activations in groups of a multiple of its 16-lane SIMD width
DQ_WITHIN_GROUPS_MEASURED = (
    "activations quantized in groups no larger than the smallest INT4 weight group the bundle stores: Gemma 3 270M's "
    "default (its lm_head INT4 in groups of 16) decoded a step 1.3-1.9x faster with groups of 16 than of 128 (2-core and "
    "16-core Intel Xeons with AMX, OpenVINO 2026.4.1, bench/op_profile.py --prop; docs/results/2026-12-one-node.md)")


def within_weight_groups(hints: dict[str, str], group: int | None) -> dict[str, str]:
    """``hints`` with dynamic quantization's group no larger than ``group``, the smallest INT4 weight group of the
    bundle (None: it has none): a compressed FullyConnected whose weight groups are smaller than its activations'
    runs its slow path (DQ_WITHIN_GROUPS_MEASURED). Off (0) stays off; the plugin takes no group under 16."""
    value = hints.get(DQ_GROUP)
    if group is None or value is None or int(value) <= 0 or int(value) <= group:
        return dict(hints)
    return {**hints, DQ_GROUP: str(max(group, MIN_DQ_GROUP))}


@dataclass(frozen=True)
class RuntimeHints:
    max_positions: int  # rotary table length: the longest context any stage can serve
    # CPU plugin properties a CPU stage applies by default (user settings override them); empty: the plugin's own
    cpu_plugin: dict[str, str] = field(default_factory=dict)
    cpu_plugin_measured: str = ""  # the measurement that chose them
    # ISA class (CPU_ISA_CLASSES) -> properties layered over cpu_plugin on a CPU of that class; absent: none
    cpu_plugin_by_isa: dict[str, dict[str, str]] = field(default_factory=dict)
    cpu_plugin_by_isa_measured: dict[str, str] = field(default_factory=dict)  # ISA class -> what chose them

    def __post_init__(self) -> None:
        for name in ("cpu_plugin_by_isa", "cpu_plugin_by_isa_measured"):
            unknown = sorted(set(getattr(self, name)) - set(CPU_ISA_CLASSES))
            if unknown:
                raise ValueError(f"{name} names the ISA class {unknown[0]!r}; expected one of "
                                 f"{', '.join(CPU_ISA_CLASSES)}")


@dataclass(frozen=True)
class Manifest:
    source: Source
    architecture: ModelDims
    weights: WeightFormat
    plan: PartitionPlan
    stages: tuple[StageEntry, ...]
    pass_log: tuple[PassRecord, ...]
    tokenizer: TokenizerFiles | None
    generation: Generation
    runtime_hints: RuntimeHints
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    extra_files: dict[str, str] = field(default_factory=dict)  # other files -> sha256
    dumps: str | None = None  # folder of the compile's graph dumps, if it made any
    # the chat template; None when the checkpoint has none (or no tokenizer), or the manifest predates the field
    chat: Chat | None = None

    def __post_init__(self) -> None:
        planned = list(self.plan.specs)
        check_tiling(planned, self.architecture.num_layers)
        held = [e.stage for e in self.stages]
        if not held or [s for s in planned if s in held] != held:  # a part holds some stages, in order, once each
            raise ValueError(f"the plan's stages {[str(s) for s in planned]} differ from the stage entries "
                             f"{[str(s) for s in held]}; expected the plan's stages, or some of them in order "
                             "(a part bundle)")

    @property
    def num_stages(self) -> int:
        """Stages of the split; a part bundle holds entries for only some of them."""
        return len(self.plan.stages)

    @property
    def kv_store(self) -> KVStore:
        """How a CPU stage of this bundle stores its KV cache under the bundle's hints (bundle/kv_store.py)."""
        return kv_store(self.runtime_hints.cpu_plugin)

    @property
    def complete(self) -> bool:
        """True when every stage of the plan is here; False for a part from ``ovshard compile --only-stage``."""
        return len(self.stages) == len(self.plan.stages)

    def describe_held(self) -> str:
        """``stage 2 of 4`` or ``stages 0, 2 of 4``: which stages of the split this bundle holds."""
        indices = ", ".join(str(e.index) for e in self.stages)
        return f"stage{'s' if len(self.stages) > 1 else ''} {indices} of {self.num_stages}"

    def to_json(self) -> str:
        return json.dumps(schema.encode(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest.json") -> Manifest:
        """The manifest ``d`` describes; BundleError naming the first unknown, missing or mistyped field."""
        if not isinstance(d, dict):
            raise BundleError(f"{where}: expected a JSON object, found {type(d).__name__}")
        found = (d.get("format"), d.get("version"))
        if found != (FORMAT_NAME, FORMAT_VERSION):
            raise BundleError(_version_message(where, *found))
        try:
            manifest: Manifest = schema.decode(cls, d, where)
        except BundleError as e:
            raise BundleError(f"{e}; the manifest is damaged or hand-edited: recompile the bundle") from e
        return manifest


def _version_message(where: str, fmt: Any, version: Any) -> str:
    if fmt != FORMAT_NAME:
        return f"{where} has format {fmt!r}, not {FORMAT_NAME!r}: it is not an ovshard bundle manifest"
    if isinstance(version, int) and version < FORMAT_VERSION:
        return (f"{where} is format version {version}, written by an older ovshard; this ovshard reads "
                f"version {FORMAT_VERSION}: recompile the bundle with `ovshard compile`")
    return (f"{where} is format version {version!r}; this ovshard reads version {FORMAT_VERSION}: "
            "upgrade ovshard (pip install -U ovshard) or recompile the bundle with this version")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def bundle_fingerprint(bundle: Path) -> str:
    """What a head and a stage must agree on: the manifest's sha256 (public: not a secret)."""
    return "sha256:" + sha256_file(Path(bundle) / names.MANIFEST_FILE)


def read_manifest(bundle: str | Path) -> Manifest:
    """Parse ``<bundle>/manifest.json`` of a complete bundle; errors say what is wrong and how to get a good one.

    A part bundle (``ovshard compile --only-stage K``) is refused: it cannot run until merged.
    """
    manifest = read_part_manifest(bundle)
    if not manifest.complete:
        raise BundleError(f"bundle {bundle} holds only {manifest.describe_held()}: it is a part from `ovshard "
                          "compile --only-stage`; merge the parts with `ovshard bundle merge PART... -o OUT` "
                          "and use the merged bundle")
    return manifest


def read_part_manifest(bundle: str | Path) -> Manifest:
    """Parse ``<bundle>/manifest.json``, a complete bundle or a part: for ``ovshard bundle merge`` only."""
    path = Path(bundle) / names.MANIFEST_FILE
    if not path.is_file():
        raise BundleError(f"{bundle} is not an ovshard bundle: {names.MANIFEST_FILE} is missing; "
                          "create one with `ovshard compile CHECKPOINT -o DIR`")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BundleError(f"{path} is not valid JSON ({e}); recompile the bundle") from e
    return Manifest.from_dict(data, where=str(path))


def shared_files(manifest: Manifest) -> dict[str, str]:
    """The files of the bundle that belong to no stage (configs, tokenizer, chat templates) -> sha256."""
    files = dict(manifest.extra_files)
    if manifest.tokenizer:
        files.update(manifest.tokenizer.sha256)
    if manifest.chat:
        files.update(manifest.chat.sha256)
    return files


def verify_files(bundle: str | Path, manifest: Manifest, stages: list[int] | None = None,
                 checked: CheckedFiles | None = None) -> None:
    """Check the sha256 of every file the manifest names (or only the given stages' files). With ``checked``,
    a file that matched before and has not changed since is not read again (ovshard.bundle.checked)."""
    root = Path(bundle)
    files: dict[str, str] = {}
    for entry in manifest.stages:
        if stages is None or entry.index in stages:
            files.update(entry.sha256)
    if stages is None:
        files.update(shared_files(manifest))
    for name, expected in files.items():
        path = root / name
        if not path.is_file():
            raise BundleError(f"{path} is missing from the bundle; copy the whole bundle folder or recompile")
        if checked is not None and checked.known(path, expected):
            continue
        found = sha256_file(path)
        if found != expected:
            raise BundleError(f"{path} has sha256 {found[:12]}..., the manifest expects {expected[:12]}...; "
                              "the file is corrupt or from another compile: copy it again or recompile")
        if checked is not None:
            checked.remember(path, expected)
