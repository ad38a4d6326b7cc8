"""Model stores as other tools leave them on disk, for the tests of model names (``ovshard compile owner/name``,
``ollama:model:tag``): a Hugging Face Hub cache, written with huggingface_hub's own helpers as snapshot_download
writes it (blobs by etag, relative snapshot links, refs/main, the cached tree listing), and an Ollama models folder
(manifests/<host>/<namespace>/<model>/<tag> and blobs/sha256-<hex>, as ollama's manifest/ and server/ packages write
them).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ovshard.frontend.resolve import OLLAMA_MODEL_LAYER

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache: Path, repo: str, files: dict[str, Path], listed: tuple[str, ...] = (),
              commit: str = COMMIT) -> Path:
    """``files`` (repository path -> local file) in ``cache`` as snapshot_download leaves them; ``listed``: more files
    the repository holds (in the cached tree listing) that were never downloaded. Returns the snapshot folder."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )
    from huggingface_hub.utils.sha import git_hash

    storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
    entries = {}
    for name, source in files.items():
        data = source.read_bytes()
        lfs = name.endswith((".safetensors", ".model", ".gguf"))  # LFS files: blob named by sha256, else git's sha1
        etag = hashlib.sha256(data).hexdigest() if lfs else git_hash(data)
        (storage / "blobs").mkdir(parents=True, exist_ok=True)
        (storage / "blobs" / etag).write_bytes(data)
        link = storage / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(storage / "blobs" / etag), str(link), new_blob=False)
        entries[name] = TreeCacheEntry(len(data), git_hash(data), etag if lfs else None, len(data) if lfs else None)
    entries |= {name: TreeCacheEntry(size=1, blob_id=git_hash(name.encode())) for name in listed}
    _cache_commit_hash_for_specific_revision(str(storage), "main", commit)
    write_tree_cache(str(storage), commit, entries)
    return storage / "snapshots" / commit


def ollama_folder(root: Path, name: tuple[str, str, str, str], gguf: Path | None,
                  layers: tuple[str, ...] = ("template", "params")) -> Path:
    """A models folder as ``ollama pull`` leaves it: manifests/<host>/<namespace>/<model>/<tag> and blobs/sha256-<hex>
    (server/images.go, manifest/manifest.go), holding ``gguf`` as the model layer and small side layers."""

    def blob(data: bytes, media_type: str) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    found = [blob(gguf.read_bytes(), OLLAMA_MODEL_LAYER)] if gguf is not None else []
    found += [blob(f"{kind} of a tiny model".encode(), f"application/vnd.ollama.image.{kind}") for kind in layers]
    manifest = root / "manifests" / Path(*name)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": blob(b'{"model_format":"gguf","model_family":"llama"}', "application/vnd.docker.container.image.v1+json"),
        "layers": found}))
    return manifest
