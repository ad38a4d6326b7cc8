"""Models by the names users type: Hugging Face Hub ids from the Hub cache, Ollama models from their manifests.

Offline (``HF_HUB_OFFLINE``), against a Hub cache and an Ollama models folder laid out as those tools lay them out
(tests/model_stores.py); the cache is checked with huggingface_hub's own ``scan_cache_dir``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_greedy, run_greedy
from model_stores import COMMIT, LoopbackHub, hub_cache, ollama_folder

from ovshard.compile import CompileConfig, compile_bundle
from ovshard.errors import CheckpointError
from ovshard.frontend.checkpoint import open_checkpoint
from ovshard.frontend.resolve import HUB_FILES, resolve_model
from ovshard.frontend.source import open_source
from ovshard.passes import WeightFormat

REPO = "tiny-org/stories260K"
# files a repository also holds that a compile must not need (never fetched, listed in the tree cache)
NOT_READ = ("pytorch_model.bin", "onnx/model.onnx", "consolidated.safetensors", "original/params.json",
            "flax_model.msgpack", "README.md")
NEW_TOKENS = 12


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache folder, used as HF_HUB_CACHE with HF_HUB_OFFLINE set (the library reads both once, at
    import: they are set on its constants too)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    for key, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setenv(key, str(int(value)) if isinstance(value, bool) else value)
        monkeypatch.setattr(constants, key, value)
    return cache


@pytest.fixture
def stories_copy(stories: Path, tmp_path: Path) -> Path:
    """stories260K copied into tmp_path, ours to shard or break."""
    return Path(shutil.copytree(stories, tmp_path / "stories-copy"))


def repo_files(folder: Path) -> dict[str, Path]:
    return {f.name: f for f in sorted(folder.iterdir()) if f.is_file()}


# ---- the Hugging Face Hub -------------------------------------------------------------------------------------

def test_hub_id_compiles_from_the_cache(stories_copy: Path, offline_hub: Path, tmp_path: Path) -> None:
    """owner/name offline: the cached snapshot (without the repo's .bin, ONNX, ...) compiles; HF's greedy tokens."""
    from huggingface_hub import scan_cache_dir

    snapshot = hub_cache(offline_hub, REPO, repo_files(stories_copy), listed=NOT_READ)
    [cached] = scan_cache_dir(offline_hub).repos  # the library reads the layout as its own
    assert cached.repo_id == REPO and {r.commit_hash for r in cached.revisions} == {COMMIT}
    manifest = compile_bundle(CompileConfig(Path(REPO), tmp_path / "bundle", weights=WeightFormat("fp32"),
                                            max_positions=64))
    assert Path(manifest.source.path) == snapshot
    prompt = [1, 403, 407]
    tokens, logits = run_greedy(tmp_path / "bundle", prompt, NEW_TOKENS)
    want, want_logits = hf_greedy(snapshot, prompt, NEW_TOKENS)
    assert tokens == want
    np.testing.assert_allclose(logits, want_logits, atol=1e-4)


def test_revision_names_a_branch_or_a_commit(stories_copy: Path, offline_hub: Path) -> None:
    """owner/name@main and owner/name@<commit> resolve to the one cached snapshot; an unknown revision is refused."""
    snapshot = hub_cache(offline_hub, REPO, repo_files(stories_copy))
    assert resolve_model(f"{REPO}@main") == resolve_model(f"{REPO}@{COMMIT}") == resolve_model(REPO) == snapshot
    with pytest.raises(CheckpointError, match=f"{REPO}@v2 is not in the Hugging Face cache"):
        resolve_model(f"{REPO}@v2")


def test_only_the_files_a_compile_reads_are_asked_for() -> None:
    """The download patterns pick config, generation config, tokenizer and safetensors files out of a real
    repository's listing, and none of its other weight formats."""
    from huggingface_hub.utils import filter_repo_objects

    listing = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "model.safetensors.index.json",
               "model.safetensors", *NOT_READ, "model-00001-of-00002.safetensors", "original/consolidated.00.pth",
               "openvino/openvino_model.bin", "LICENSE", ".gitattributes", "model.gguf"]
    picked = set(filter_repo_objects(items=listing, allow_patterns=list(HUB_FILES)))
    assert picked == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                      "special_tokens_map.json", "tokenizer.model", "chat_template.jinja",
                      "model.safetensors.index.json", "model.safetensors"}


def test_sharded_checkpoint_needs_only_the_shards_its_index_names(stories_copy: Path, offline_hub: Path) -> None:
    """A sharded repository resolves with the index's shards alone (stray shards listed, never fetched)."""
    from transformers import AutoModelForCausalLM

    sharded = stories_copy.parent / "sharded"
    model = AutoModelForCausalLM.from_pretrained(stories_copy, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="300KB")
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(stories_copy / name, sharded / name)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    hub_cache(offline_hub, REPO, repo_files(sharded), listed=("model-old-00001-of-00009.safetensors", *NOT_READ))
    ckpt = open_source(REPO)
    assert ckpt.weight_files == tuple(shards)
    assert ckpt.fingerprint() == open_checkpoint(sharded).fingerprint()


def test_a_gguf_file_in_a_hub_repository(tiny_gguf: Path, offline_hub: Path) -> None:
    """owner/name/FILE.gguf opens that one GGUF file of the snapshot; a file the repository lacks, or the repository
    without a file named (no config.json), is refused with the GGUF files it holds."""
    from ovshard.frontend.gguf import open_gguf

    snapshot = hub_cache(offline_hub, "tiny-org/gguf-repo", {"q8/tiny-llama.gguf": tiny_gguf}, listed=("README.md",))
    ckpt = open_source("tiny-org/gguf-repo/q8/tiny-llama.gguf")
    assert ckpt.path == snapshot / "q8" / "tiny-llama.gguf"
    assert ckpt.fingerprint() == open_gguf(tiny_gguf).fingerprint()
    with pytest.raises(CheckpointError, match="has no file model-Q4_K_M.gguf; it holds q8/tiny-llama.gguf"):
        resolve_model("tiny-org/gguf-repo/model-Q4_K_M.gguf")
    with pytest.raises(CheckpointError, match=r"has no config\.json.*tiny-org/gguf-repo/FILE\.gguf"):
        resolve_model("tiny-org/gguf-repo")


def test_offline_and_not_cached_names_the_id_the_cache_and_the_fix(offline_hub: Path) -> None:
    """A Hub id the cache lacks, offline: the error names the id, the cache folder and what to do."""
    with pytest.raises(CheckpointError) as e:
        open_source("Qwen/Qwen3-30B-A3B")
    message = str(e.value)
    for fragment in ("Qwen/Qwen3-30B-A3B is not in the Hugging Face cache",
                     str(offline_hub / "models--Qwen--Qwen3-30B-A3B"), "HF_HUB_OFFLINE is set", "network access"):
        assert fragment in message, message


def test_an_interrupted_download_says_to_finish_it(stories_copy: Path, offline_hub: Path) -> None:
    """A snapshot whose listing names a weight file that never arrived is refused offline as incomplete."""
    files = repo_files(stories_copy)
    del files["model.safetensors"]
    hub_cache(offline_hub, REPO, files, listed=("model.safetensors",))
    with pytest.raises(CheckpointError, match=r"is incomplete.*model\.safetensors.*finish the download"):
        open_source(REPO)


@pytest.mark.parametrize("name", ["tiny-org/bad name", "tiny-org/two--dashes", "tiny-org/-leading", "a b/c"])
def test_a_hub_id_with_bad_characters_is_refused(name: str, offline_hub: Path) -> None:
    """A name shaped like owner/name that neither exists nor is a valid Hub id: refused, saying both."""
    with pytest.raises(CheckpointError, match="is neither a local path nor a Hugging Face Hub id"):
        open_source(name)


def test_an_existing_local_path_wins_over_a_hub_id(stories_copy: Path, offline_hub: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder spelled like a cached Hub id is opened as the folder, not the cached snapshot."""
    hub_cache(offline_hub, REPO, repo_files(stories_copy))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(stories_copy, tmp_path / REPO)
    assert resolve_model(REPO) == Path(REPO)
    assert open_source(REPO).path.resolve() == (tmp_path / REPO).resolve()


# ---- downloads, from a Hub repository on loopback -----------------------------------------------------------

@pytest.fixture
def online_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[str, bytes]], LoopbackHub]]:
    """Serve a repository as REPO on loopback (HF_ENDPOINT) into an empty cache; small download chunks, so that an
    interrupted file leaves bytes to resume from."""
    from huggingface_hub import constants

    hubs: list[LoopbackHub] = []

    def serve(files: dict[str, bytes]) -> LoopbackHub:
        hubs.append(LoopbackHub(REPO, files))
        monkeypatch.setattr(constants, "ENDPOINT", hubs[-1].url)  # both as the library derives them from HF_ENDPOINT
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hubs[-1].url + "/{repo_id}/resolve/{revision}/{filename}")
        return hubs[-1]

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    yield serve
    for hub in hubs:
        hub.close()


def contents(folder: Path) -> dict[str, bytes]:
    return {name: path.read_bytes() for name, path in repo_files(folder).items()}


COMPILE_READS = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                 "special_tokens_map.json"}


def test_a_download_fetches_only_what_a_compile_reads(stories: Path, online_hub, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """huggingface_hub downloads the configs, tokenizer and safetensors, none of the repository's other files; the
    cache it wrote then serves offline."""
    from huggingface_hub import constants

    hub = online_hub(contents(stories) | {name: b"not read" * 100 for name in NOT_READ})
    snapshot = resolve_model(REPO)
    assert hub.fetched() == COMPILE_READS | {"model.safetensors"}
    hub.close()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert open_source(REPO).path == snapshot
    assert open_source(REPO).fingerprint() == open_checkpoint(stories).fingerprint()


def test_a_sharded_download_fetches_the_index_then_its_shards(stories_copy: Path, online_hub) -> None:  # noqa: ANN001
    """The index first, then exactly the shards its weight_map names (not a stray shard beside them)."""
    from transformers import AutoModelForCausalLM

    sharded = stories_copy.parent / "sharded"
    AutoModelForCausalLM.from_pretrained(stories_copy, dtype=torch.float32).save_pretrained(sharded, max_shard_size="300KB")
    files = contents(sharded) | {"model-old-00001-of-00009.safetensors": b"stale" * 100}
    hub = online_hub(files)
    ckpt = open_source(REPO)
    shards = {name for name in files if name.startswith("model-0")}
    assert hub.fetched() == {"config.json", "generation_config.json", "model.safetensors.index.json"} | shards
    assert set(ckpt.weight_files) == shards


def test_a_dropped_download_resumes_and_a_rerun_fetches_only_what_is_missing(stories: Path, online_hub) -> None:  # noqa: ANN001
    """A connection dropped mid-file resumes from the bytes received (Range); past the library's retries it is a clear
    error, and the next run fetches that file alone."""
    files = contents(stories)
    hub = online_hub(files)
    hub.cut = {"model.safetensors"}  # each answer sends half of what is asked for, then drops the connection
    with pytest.raises(CheckpointError, match="failed .*run again: the files that arrived whole stay in the cache"):
        resolve_model(REPO)
    starts = [int(r.removeprefix("bytes=").split("-")[0]) for method, path, r in hub.requests
              if method == "GET" and path.endswith("/model.safetensors") and r is not None]
    assert starts and starts == sorted(starts) and starts[0] > 0, starts
    first_run, hub.cut = len(hub.requests), set()
    snapshot = resolve_model(REPO)
    again = {path.rsplit("/", 1)[-1] for method, path, _ in hub.requests[first_run:] if method == "GET" and "/resolve/" in path}
    assert again == {"model.safetensors"}
    assert (snapshot / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_the_hubs_refusals_say_what_to_do(stories: Path, online_hub) -> None:  # noqa: ANN001
    """An unknown repository, an unknown revision and a gated repository each get their own clear error."""
    hub = online_hub(contents(stories))
    with pytest.raises(CheckpointError, match="no Hugging Face Hub repository tiny-org/missing .*HF_TOKEN"):
        resolve_model("tiny-org/missing")
    with pytest.raises(CheckpointError, match=f"{REPO} has no revision 'v9'"):
        resolve_model(f"{REPO}@v9")
    hub.gated = True
    with pytest.raises(CheckpointError, match=f"{REPO} is gated: accept its terms at https://huggingface.co/{REPO} "
                                              "and set HF_TOKEN"):
        resolve_model(REPO)


# ---- Ollama ----------------------------------------------------------------------------------------------------

@pytest.fixture
def ollama_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "ollama-models"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """A tiny random llama GGUF as llama.cpp writes one (tests/dense_gguf.py's writer)."""
    from dense_gguf import hf_weights, write_gguf

    return write_gguf(tmp_path / "tiny-llama.gguf", "llama", hf_weights("llama"))


def test_ollama_model_compiles(tiny_gguf: Path, ollama_models: Path, tmp_path: Path) -> None:
    """ollama:name (tag latest) is its GGUF blob; the bundle greedy-decodes as transformers reads that GGUF."""
    from transformers import AutoModelForCausalLM

    ollama_folder(ollama_models, ("registry.ollama.ai", "library", "tiny-llama", "latest"), tiny_gguf)
    blob = resolve_model("ollama:tiny-llama")
    assert blob.parent == ollama_models / "blobs" and blob.read_bytes() == tiny_gguf.read_bytes()
    assert resolve_model("ollama:tiny-llama:latest") == resolve_model("ollama:library/tiny-llama") == blob
    manifest = compile_bundle(CompileConfig(Path("ollama:tiny-llama"), tmp_path / "bundle",
                                            weights=WeightFormat("fp32"), max_positions=64))
    assert Path(manifest.source.path) == blob
    model = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32).eval()
    prompt = [1, 17, 42, 5]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens, logits = run_greedy(tmp_path / "bundle", prompt, NEW_TOKENS)
    assert tokens == out.sequences[0, len(prompt):].tolist()
    np.testing.assert_allclose(logits, torch.stack([row[0] for row in out.logits]).numpy(), atol=1e-4)


def test_ollama_names_follow_ollamas_defaults(tiny_gguf: Path, ollama_models: Path) -> None:
    """A namespace and a tag land where Ollama keeps them: manifests/registry.ollama.ai/<namespace>/<model>/<tag>."""
    ollama_folder(ollama_models, ("registry.ollama.ai", "someone", "qwen3", "30b-a3b-q4_K_M"), tiny_gguf)
    ollama_folder(ollama_models, ("hf.co", "unsloth", "Qwen3-30B-A3B-GGUF", "Q4_K_M"), tiny_gguf)
    assert resolve_model("ollama:someone/qwen3:30b-a3b-q4_K_M").parent == ollama_models / "blobs"
    assert resolve_model("ollama:hf.co/unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M").parent == ollama_models / "blobs"


def test_ollama_model_not_pulled(ollama_models: Path) -> None:
    """A name without a manifest: the error names the manifest path looked for and `ollama pull`."""
    expected = ollama_models / "manifests" / "registry.ollama.ai" / "library" / "qwen3" / "30b"
    with pytest.raises(CheckpointError) as e:
        open_source("ollama:qwen3:30b")
    assert str(expected) in str(e.value) and "ollama pull qwen3:30b" in str(e.value) and "OLLAMA_MODELS" in str(e.value)


def test_ollama_manifest_without_a_model_layer(ollama_models: Path) -> None:
    """A manifest with no GGUF model layer (e.g. a model kept as tensor layers) is refused, naming what it has."""
    ollama_folder(ollama_models, ("registry.ollama.ai", "library", "split", "latest"), None, layers=("tensor", "params"))
    with pytest.raises(CheckpointError, match=r"no model layer \(application/vnd\.ollama\.image\.model\); found "
                                              r".*image\.params, .*image\.tensor"):
        open_source("ollama:split")


def test_ollama_blob_missing_or_short(tiny_gguf: Path, ollama_models: Path) -> None:
    """A model blob that is gone, or shorter than the manifest says (a broken pull): refused, saying pull again."""
    ollama_folder(ollama_models, ("registry.ollama.ai", "library", "tiny-llama", "latest"), tiny_gguf)
    blob = resolve_model("ollama:tiny-llama")
    blob.write_bytes(blob.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"is 100 bytes, the manifest says \d+ bytes; pull the model again"):
        open_source("ollama:tiny-llama")
    blob.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        open_source("ollama:tiny-llama")


@pytest.mark.parametrize("name", ["ollama:", "ollama:bad name", "ollama:qwen3:", "ollama:-x:latest", "ollama:a/b/c/d:e"])
def test_bad_ollama_names(name: str, ollama_models: Path) -> None:
    """Names Ollama would not accept are refused with the expected form."""
    with pytest.raises(CheckpointError, match=r"is not an Ollama model name .*ollama:\[host/\]\[namespace/\]model"):
        open_source(name)
