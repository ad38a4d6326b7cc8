"""Model stores as other tools leave them on disk, for the tests of model names (``ovshard compile owner/name``,
``ollama:model:tag``): a Hugging Face Hub cache, written with huggingface_hub's own helpers as snapshot_download
writes it (blobs by etag, relative snapshot links, refs/main, the cached tree listing), an Ollama models folder
(manifests/<host>/<namespace>/<model>/<tag> and blobs/sha256-<hex>, as ollama's manifest/ and server/ packages write
them), and a Hub repository served on loopback for the download path.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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

    storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
    entries = {}
    for name, source in files.items():
        data = source.read_bytes()
        lfs, etag = _lfs(name), _etag(name, data)
        (storage / "blobs").mkdir(parents=True, exist_ok=True)
        (storage / "blobs" / etag).write_bytes(data)
        link = storage / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(storage / "blobs" / etag), str(link), new_blob=False)
        entries[name] = TreeCacheEntry(len(data), _git_hash(data), etag if lfs else None, len(data) if lfs else None)
    entries |= {name: TreeCacheEntry(size=1, blob_id=_git_hash(name.encode())) for name in listed}
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


class LoopbackHub:
    """One model repository served on loopback over the Hugging Face Hub's HTTP API, the endpoints huggingface_hub's
    ``snapshot_download`` calls (revision info, the recursive tree, HEAD/GET ``resolve/<commit>/<file>`` with
    ``Range``), so that the real library downloads into a real cache (``HF_ENDPOINT`` = :attr:`url`).

    ``requests`` logs (method, path, Range header); a file in ``cut`` is sent half and the connection dropped, every
    time, until it is taken out of ``cut`` (an interrupted download). Errors carry the Hub's ``X-Error-Code``: another
    repository is RepoNotFound, another revision than main RevisionNotFound, everything GatedRepo while ``gated``.
    """

    def __init__(self, repo: str, files: dict[str, bytes], commit: str = COMMIT) -> None:
        self.repo, self.files, self.commit = repo, files, commit
        self.requests: list[tuple[str, str, str | None]] = []
        self.cut: set[str] = set()
        self.gated = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
                pass

            def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
                hub.answer(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self) -> set[str]:
        """The files whose bytes were asked for (GET of resolve/...)."""
        prefix = f"/{self.repo}/resolve/{self.commit}/"
        return {path.removeprefix(prefix) for method, path, _ in self.requests if method == "GET" and path.startswith(prefix)}

    def answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = request.path.split("?")[0]
        self.requests.append((request.command, path, request.headers.get("Range")))
        if self.gated:
            return _error(request, 403, "GatedRepo")
        if path.startswith("/api/models/") and not path.startswith(f"/api/models/{self.repo}/"):
            return _error(request, 404, "RepoNotFound")
        if path.startswith(f"/api/models/{self.repo}/revision/") and not path.endswith("/main"):
            return _error(request, 404, "RevisionNotFound")
        if path == f"/api/models/{self.repo}/revision/main":
            return _json(request, {"id": self.repo, "sha": self.commit, "siblings": [{"rfilename": f} for f in self.files]})
        if path == f"/api/models/{self.repo}/tree/{self.commit}":
            return _json(request, [self._entry(f) for f in sorted(self.files)])
        name = path.removeprefix(f"/{self.repo}/resolve/{self.commit}/")
        if name not in self.files or name == path:
            return _error(request, 404, "EntryNotFound")
        data = self.files[name]
        start = int((request.headers.get("Range") or "bytes=0-").removeprefix("bytes=").split("-")[0])
        request.send_response(206 if start else 200)
        request.send_header("X-Repo-Commit", self.commit)
        request.send_header("ETag", f'"{_etag(name, data)}"')
        request.send_header("Content-Length", str(len(data) - start))
        request.end_headers()
        if body:
            sent = data[start:start + (len(data) - start) // 2] if name in self.cut else data[start:]
            request.wfile.write(sent)
            if name in self.cut:
                request.wfile.flush()
                request.connection.shutdown(socket.SHUT_RDWR)
                request.close_connection = True
        return None

    def _entry(self, name: str) -> dict[str, object]:
        data = self.files[name]
        entry: dict[str, object] = {"type": "file", "oid": _git_hash(data), "size": len(data), "path": name}
        if _lfs(name):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry


def _json(request: BaseHTTPRequestHandler, value: object) -> None:
    body = json.dumps(value).encode()
    request.send_response(200)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    request.wfile.write(body)


def _error(request: BaseHTTPRequestHandler, status: int, code: str) -> None:
    request.send_response(status)
    request.send_header("X-Error-Code", code)
    request.send_header("Content-Length", "0")
    request.end_headers()


def _lfs(name: str) -> bool:
    """Files the Hub keeps in LFS here: their cache blob is named by sha256, the others' by git's sha1."""
    return name.endswith((".safetensors", ".model", ".gguf", ".bin", ".onnx"))


def _etag(name: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if _lfs(name) else _git_hash(data)


def _git_hash(data: bytes) -> str:
    from huggingface_hub.utils.sha import git_hash

    return git_hash(data)
