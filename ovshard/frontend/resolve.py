"""Turn the model a user names into a local path: a folder or file as it is, a Hugging Face Hub id, an Ollama model.

- A path that exists is used as it is, whatever it looks like (it wins over a Hub id of the same spelling).
- ``owner/name[@revision]``: a Hub repository, fetched with ``huggingface_hub`` into its standard cache
  (``HF_HUB_CACHE``, default ``$HF_HOME/hub``; ``HF_TOKEN`` for gated or private repositories; a dropped
  connection resumes, and a rerun fetches only the files not yet cached; ``HF_HUB_OFFLINE=1`` uses the cache
  alone). Only the files a compile reads come down: config.json, generation_config.json, the tokenizer's files,
  and ``model.safetensors`` or the index and the shards it names. ``owner/name/path/file.gguf[@revision]``
  fetches that one GGUF file instead.
- ``ollama:[host/][namespace/]model[:tag]``: a model Ollama has pulled, read from its manifest
  (``$OLLAMA_MODELS`` or ``~/.ollama/models``: ``manifests/<host>/<namespace>/<model>/<tag>``, defaults
  registry.ollama.ai, library, latest, as Ollama's ``types/model/name.go`` parses names). Its model layer is a
  GGUF blob, ``blobs/sha256-<hex>``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from ovshard.errors import CheckpointError
from ovshard.frontend.checkpoint import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    TOKENIZER_FILES,
)

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
OLLAMA_PREFIX = "ollama:"
# what AutoTokenizer reads beside the weights (tokenizer.json / tokenizer.model are TOKENIZER_FILES)
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                    "merges.txt", "chat_template.jinja", "chat_template.json", "additional_chat_templates/*")
HUB_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE, *TOKENIZER_FILES, *TOKENIZER_EXTRAS, SINGLE_FILE, INDEX_FILE)
# owner/name, an optional GGUF file inside the repository, an optional revision (which may hold '/')
HUB_SHAPE = re.compile(r"(?P<repo>[^/@]+/[^/@]+)(?:/(?P<file>[^@]+\.gguf))?(?:@(?P<revision>.+))?")

OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_DIGEST = re.compile(r"sha256[:-][0-9a-fA-F]{64}")
OLLAMA_SERVICE_MODELS = "/usr/share/ollama/.ollama/models"  # where Linux's system-wide install keeps them
# a name part as Ollama's isValidPart accepts it: host may hold '.' and ':', namespace neither, model and tag '.'
OLLAMA_PART = {"host": re.compile(r"\w[\w.:-]{0,349}", re.ASCII), "namespace": re.compile(r"\w[\w-]{0,79}", re.ASCII),
               "model": re.compile(r"\w[\w.-]{0,79}", re.ASCII), "tag": re.compile(r"\w[\w.-]{0,79}", re.ASCII)}


def is_gguf(path: Path) -> bool:
    """Whether ``path`` names a GGUF file (by suffix, or by content for a file without one)."""
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def resolve_model(name: str | Path) -> Path:
    """The local folder or GGUF file that ``name`` (a path, a Hub id or ``ollama:...``) stands for."""
    text = str(name)
    if Path(text).expanduser().exists():
        return Path(text).expanduser()
    if text.startswith(OLLAMA_PREFIX):
        return ollama_blob(text[len(OLLAMA_PREFIX):])
    shape = None if text.startswith((".", "~", "/")) else HUB_SHAPE.fullmatch(text)
    if shape is None:
        return Path(text)  # not a name: the readers say the path does not exist
    return hub_snapshot(shape["repo"], shape["file"], shape["revision"])


# ---- the Hugging Face Hub -------------------------------------------------------------------------------------

def hub_snapshot(repo: str, file: str | None = None, revision: str | None = None) -> Path:
    """The cached snapshot folder of ``repo`` holding what a compile reads (``file``: that GGUF file's path)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise CheckpointError(f"{repo} is neither a local path nor a Hugging Face Hub id ({e}); expected an existing "
                              "folder or file, or owner/name[@revision] as on huggingface.co") from e
    if file is not None:
        folder = _download(repo, revision, [file])
        if not (folder / file).is_file():
            raise CheckpointError(f"the Hub repository {repo}{_at(revision)} has no file {file}; "
                                  f"{_listing(repo, folder, '.gguf')}")
        return folder / file
    folder = _download(repo, revision, list(HUB_FILES))
    if not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(f"the Hub repository {repo}{_at(revision)} has no {CONFIG_FILE}; ovshard compiles a "
                              f"transformers checkpoint or one GGUF file of a repository (name it: "
                              f"{repo}/FILE.gguf); {_listing(repo, folder, '.gguf')}")
    shards = [] if (folder / SINGLE_FILE).is_file() else _shards(folder / INDEX_FILE)
    if shards:  # the snapshot's commit, so that the shards match the index
        folder = _download(repo, folder.name, shards)
    if not (folder / SINGLE_FILE).is_file() and not (folder / INDEX_FILE).is_file():
        raise CheckpointError(f"the Hub repository {repo}{_at(revision)} has neither {SINGLE_FILE} nor "
                              f"{INDEX_FILE}; ovshard reads safetensors weights (or one GGUF file: "
                              f"{repo}/FILE.gguf); {_listing(repo, folder, '')}")
    return folder


def _download(repo: str, revision: str | None, patterns: list[str]) -> Path:
    """``snapshot_download`` of the files matching ``patterns``, its failures turned into CheckpointErrors."""
    import httpx2
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.file_download import repo_folder_name

    cache = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    log.info("%s%s: the files a compile reads (%d names or patterns), from the Hugging Face cache %s or the Hub",
             repo, _at(revision), len(patterns), cache)
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except GatedRepoError as e:
        raise CheckpointError(f"{repo} is gated: accept its terms at https://huggingface.co/{repo} and set "
                              "HF_TOKEN (or run `hf auth login`) with a token of that account") from e
    except RepositoryNotFoundError as e:
        raise CheckpointError(f"no Hugging Face Hub repository {repo} (or it is private: set HF_TOKEN), and no local "
                              f"path {repo}; check the spelling (at https://huggingface.co for a Hub id)") from e
    except RevisionNotFoundError as e:
        raise CheckpointError(f"the Hub repository {repo} has no revision {revision!r}; name a branch, tag or "
                              "commit it has") from e
    except IncompleteSnapshotError as e:
        raise CheckpointError(f"the cached copy of {repo}{_at(revision)} in {cache} is incomplete and the Hub "
                              f"cannot be reached ({e}); run again with network access (without HF_HUB_OFFLINE) "
                              "to finish the download") from e
    except LocalEntryNotFoundError as e:
        raise CheckpointError(f"{repo}{_at(revision)} is not in the Hugging Face cache ({cache}) and the Hub cannot "
                              f"be reached{' (HF_HUB_OFFLINE is set)' if constants.HF_HUB_OFFLINE else ''}; run "
                              "once with network access (without HF_HUB_OFFLINE) to download it, point HF_HUB_CACHE "
                              f"(or HF_HOME) at a cache that holds it, or pass a local folder (there is no local "
                              f"path {repo})") from e
    except HfHubHTTPError as e:
        raise CheckpointError(f"the Hugging Face Hub refused {repo}{_at(revision)}: {e}") from e
    except (OSError, httpx2.HTTPError) as e:  # a connection lost past the library's retries, a full disk
        raise CheckpointError(f"downloading {repo}{_at(revision)} into {cache} failed ({e}); run again: the files "
                              "that arrived whole stay in the cache and are not fetched again") from e


def _shards(index: Path) -> list[str]:
    """The shard files a safetensors index maps tensors to; none when it is missing or malformed (the
    checkpoint reader then says what is wrong with it)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return []
    return sorted({str(f) for f in weight_map.values()}) if isinstance(weight_map, dict) else []


def _listing(repo: str, folder: Path, suffix: str) -> str:
    """What the repository holds (its files ending in ``suffix``), from the listing the download cached."""
    from huggingface_hub import get_cached_repo_tree

    try:
        files = sorted(f.path for f in get_cached_repo_tree(repo, revision=folder.name) if f.path.endswith(suffix))
    except Exception:  # no cached listing (offline): say where to look instead
        return f"see its files at https://huggingface.co/{repo}/tree/{folder.name}"
    if not files:
        return f"it holds no {suffix} files" if suffix else "it holds no files"
    more = f" and {len(files) - 8} more" if len(files) > 8 else ""
    return f"it holds {', '.join(files[:8])}{more}"


def _at(revision: str | None) -> str:
    return f"@{revision}" if revision else ""


# ---- Ollama ----------------------------------------------------------------------------------------------------

def ollama_models() -> Path:
    """Ollama's models folder: ``$OLLAMA_MODELS``, else ``~/.ollama/models`` (envconfig.Models)."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def ollama_name(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) of an Ollama name, defaults filled in as Ollama's ParseName does."""
    rest, tag = name, OLLAMA_TAG
    if rest.rfind(":") > rest.rfind("/"):
        rest, tag = rest.rsplit(":", 1)
    parts = rest.split("/")
    if len(parts) > 3:
        parts = ["/".join(parts[:-2]), *parts[-2:]]
    host, namespace, model = [OLLAMA_HOST, OLLAMA_NAMESPACE][: 3 - len(parts)] + parts
    host = host.split("://", 1)[-1]
    fields = {"host": host, "namespace": namespace, "model": model, "tag": tag}
    bad = [f"{kind} {value!r}" for kind, value in fields.items() if not OLLAMA_PART[kind].fullmatch(value)]
    if bad:
        raise CheckpointError(f"ollama:{name} is not an Ollama model name "
                              f"({', '.join(bad)}); expected ollama:[host/][namespace/]model[:tag] as `ollama list` "
                              "shows it, e.g. ollama:qwen3:30b (letters, digits, '_', '-', '.')")
    return host, namespace, model, tag


def ollama_blob(name: str) -> Path:
    """The GGUF blob of the Ollama model ``name`` (``qwen3:30b``; tag ``latest`` when none is given)."""
    host, namespace, model, tag = ollama_name(name)
    root = ollama_models()
    manifest = root / "manifests" / host / namespace / model / tag
    shown = f"ollama:{model}:{tag}" if (host, namespace) == (OLLAMA_HOST, OLLAMA_NAMESPACE) else f"ollama:{name}"
    if not manifest.is_file():
        raise CheckpointError(
            f"{shown}: Ollama has no such model in {root} (no manifest {manifest}); pull it with `ollama pull "
            f"{shown.removeprefix(OLLAMA_PREFIX)}`, or set OLLAMA_MODELS to Ollama's models folder (default "
            f"~/.ollama/models; {OLLAMA_SERVICE_MODELS} for Ollama installed as a Linux service)")
    layer = _model_layer(manifest, shown)
    digest = str(layer.get("digest", ""))
    if not OLLAMA_DIGEST.fullmatch(digest):
        raise CheckpointError(f"{shown}: the manifest {manifest} names the model blob {digest!r}; expected "
                              "sha256:<64 hex digits>; pull the model again")
    blob = root / "blobs" / digest.replace(":", "-")
    size = layer.get("size")
    if not blob.is_file() or (isinstance(size, int) and blob.stat().st_size != size):
        found = f"{blob.stat().st_size} bytes" if blob.is_file() else "missing"
        raise CheckpointError(f"{shown}: its model blob {blob} is {found}, the manifest says {size} bytes; pull the "
                              f"model again (`ollama pull {shown.removeprefix(OLLAMA_PREFIX)}`)")
    if not is_gguf(blob):
        raise CheckpointError(f"{shown}: its model blob {blob} is not a GGUF file; ovshard reads GGUF (Ollama's "
                              "format since 2023): pull the model again with a current Ollama")
    log.info("%s is the GGUF blob %s", shown, blob)
    return blob


def _model_layer(manifest: Path, shown: str) -> dict[str, Any]:
    """The manifest's one layer of media type ``application/vnd.ollama.image.model``."""
    try:
        layers = json.loads(manifest.read_text()).get("layers")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{shown}: its manifest {manifest} is not the JSON object Ollama writes ({e}); "
                              "pull the model again") from e
    layers = [x for x in layers if isinstance(x, dict)] if isinstance(layers, list) else []
    found = [x for x in layers if x.get("mediaType") == OLLAMA_MODEL_LAYER]
    if not found:
        kinds = sorted({str(x.get("mediaType")) for x in layers}) or ["none"]
        raise CheckpointError(
            f"{shown}: its manifest {manifest} has no model layer ({OLLAMA_MODEL_LAYER}); found {', '.join(kinds)}. "
            "Ollama keeps this model in another form than one GGUF file: compile its Hugging Face checkpoint instead")
    return found[0]
