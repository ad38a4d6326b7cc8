"""The bundle contract: ``manifest.json`` as frozen dataclasses, and reading a bundle back.

This module imports only the standard library: the runtime reads manifests on nodes that have no
torch, transformers or nncf.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ovshard import names
from ovshard.errors import BundleError

FORMAT_NAME = "ovshard-bundle"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorSpec:
    name: str
    element_type: str  # OpenVINO type name: "i64", "f32", ...
    shape: str  # partial shape, e.g. "[?,?,64]"


@dataclass(frozen=True)
class StageEntry:
    index: int
    layers: tuple[int, int]  # half-open [start, end)
    model_xml: str
    model_bin: str
    sha256: dict[str, str]  # file name -> hex digest, for model_xml and model_bin
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    state_variables: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    source: dict[str, Any]  # path, fingerprint, model_type
    architecture: dict[str, Any]  # ModelDims as a dict
    weights: dict[str, Any]  # WeightFormat as a dict
    plan: dict[str, Any]  # PartitionPlan as a dict
    stages: tuple[StageEntry, ...]
    pass_log: tuple[dict[str, Any], ...]  # {stage, name, modified, seconds}
    tokenizer: dict[str, str] | None  # {"tokenizer": file, "detokenizer": file, "sha256": {...}} or None
    generation: dict[str, Any]  # bos_token_id, eos_token_ids, pad_token_id
    runtime_hints: dict[str, Any]  # max_positions, activation element type, ...
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    extra_files: dict[str, str] = field(default_factory=dict)  # other files -> sha256
    dumps: str | None = None  # folder of the compile's graph dumps, if it made any

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        stages = tuple(
            StageEntry(
                index=s["index"],
                layers=tuple(s["layers"]),
                model_xml=s["model_xml"],
                model_bin=s["model_bin"],
                sha256=dict(s["sha256"]),
                inputs=tuple(TensorSpec(**t) for t in s["inputs"]),
                outputs=tuple(TensorSpec(**t) for t in s["outputs"]),
                state_variables=tuple(s["state_variables"]),
            )
            for s in d["stages"]
        )
        fields = {k: d[k] for k in ("source", "architecture", "weights", "plan", "tokenizer", "generation",
                                    "runtime_hints", "format", "version")}
        return cls(stages=stages, pass_log=tuple(d["pass_log"]), extra_files=d.get("extra_files", {}),
                   dumps=d.get("dumps"), **fields)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(bundle: str | Path) -> Manifest:
    """Parse ``<bundle>/manifest.json``; errors say what is wrong and how to get a good bundle."""
    path = Path(bundle) / names.MANIFEST_FILE
    if not path.is_file():
        raise BundleError(f"{bundle} is not an ovshard bundle: {names.MANIFEST_FILE} is missing; "
                          "create one with `ovshard compile CHECKPOINT -o DIR`")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BundleError(f"{path} is not valid JSON ({e}); recompile the bundle") from e
    if data.get("format") != FORMAT_NAME or data.get("version") != FORMAT_VERSION:
        raise BundleError(f"{path} has format {data.get('format')!r} version {data.get('version')!r}; "
                          f"this ovshard reads {FORMAT_NAME!r} version {FORMAT_VERSION}")
    try:
        return Manifest.from_dict(data)
    except (KeyError, TypeError) as e:
        raise BundleError(f"{path} lacks or mangles the field {e}; recompile the bundle") from e


def verify_files(bundle: str | Path, manifest: Manifest, stages: list[int] | None = None) -> None:
    """Check the sha256 of every file the manifest names (or only the given stages' files)."""
    root = Path(bundle)
    files: dict[str, str] = {}
    for entry in manifest.stages:
        if stages is None or entry.index in stages:
            files.update(entry.sha256)
    if stages is None:
        files.update(manifest.extra_files)
        if manifest.tokenizer:
            files.update(manifest.tokenizer.get("sha256", {}))
    for name, expected in files.items():
        path = root / name
        if not path.is_file():
            raise BundleError(f"{path} is missing from the bundle; copy the whole bundle folder or recompile")
        found = sha256_file(path)
        if found != expected:
            raise BundleError(f"{path} has sha256 {found[:12]}..., the manifest expects {expected[:12]}...; "
                              "the file is corrupt or from another compile: copy it again or recompile")
