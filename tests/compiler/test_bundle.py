"""The bundle contract: manifest fields, stage I/O names, checksums, tokenizer, lazy per-stage loading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from conftest import compile_fp32, run_greedy

from ovshard.bundle import names
from ovshard.bundle.manifest import read_manifest, verify_files
from ovshard.bundle.stage import StageSpec
from ovshard.frontend.checkpoint import open_checkpoint
from ovshard.frontend.tensors import layer_tensors
from ovshard.frontend.trace import trace_stage
from ovshard.tools.synth import llama_config, write_checkpoint


@pytest.fixture(scope="module")
def stories_bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("bundle") / "b", stages=3)


def test_manifest_describes_every_stage(stories_bundle: Path) -> None:
    """Stage entries carry half-open ranges covering all layers, contract I/O names and their state ids."""
    m = read_manifest(stories_bundle)
    assert [e.layers for e in m.stages] == [(0, 2), (2, 4), (4, 5)]  # the tied head weighs on the last stage
    for e in m.stages:
        inputs = [(t.name, t.element_type) for t in e.inputs]
        first = (names.INPUT_IDS, "i64") if e.index == 0 else (names.HIDDEN_STATES, "f32")
        assert inputs == [first, (names.ATTENTION_MASK, "i64"), (names.POSITION_IDS, "i64"), (names.BEAM_IDX, "i32")]
        assert len(e.outputs) == 1
        assert e.outputs[0].shape.endswith(",512]" if e.index == m.num_stages - 1 else ",64]")
        assert list(e.state_variables) == sorted(
            n for i in range(*e.layers) for n in (names.past_key(i), names.past_value(i)))
    assert m.stages[-1].outputs[0].name == names.LOGITS
    assert m.weights.mode == "fp32"
    assert m.generation.eos_token_ids == (2, 1)
    assert {r.name for r in m.pass_log} == {"PrecomputeRotaryPass", "MakeStatefulKVPass", "InjectBeamIdxGatherPass",
                                               "CompressWeightsPass", "FuseProjectionsPass", "SplitZeroPointsPass"}
    assert m.source.fingerprint.startswith("sha256:")
    assert json.loads((stories_bundle / names.MANIFEST_FILE).read_text())["plan"]["strategy"] == "balanced-reads"


def test_checksums_verify(stories_bundle: Path) -> None:
    """verify_files accepts the bundle as written: every stage, tokenizer and config file hashes as recorded."""
    verify_files(stories_bundle, read_manifest(stories_bundle))


def test_tokenizer_matches_hugging_face(stories: Path, stories_bundle: Path) -> None:
    """The bundle's OpenVINO tokenizer and detokenizer give Hugging Face's ids and text."""
    import openvino_tokenizers  # noqa: F401
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(stories)
    core = ov.Core()
    tok = core.compile_model(str(stories_bundle / names.TOKENIZER_XML), "CPU")
    detok = core.compile_model(str(stories_bundle / names.DETOKENIZER_XML), "CPU")
    texts = ["Once upon a time", "Lily and Ben went to the park.", "  spaces  and\nnewlines ", "Zebra? 123!",
             "The little dog said, \"Hi!\"", "ünïcode ☃ text"]
    for text in texts:
        ids = tok([text])["input_ids"][0].tolist()
        assert ids == hf(text)["input_ids"], text
        assert str(detok(np.array([ids]))["string_output"][0]) == hf.decode(ids, skip_special_tokens=True)


def test_checkpoint_without_tokenizer_still_compiles(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A random checkpoint with no tokenizer files compiles with a warning and a manifest saying so."""
    checkpoint = write_checkpoint(tmp_path / "ckpt", llama_config())
    with caplog.at_level("WARNING"):
        bundle = compile_fp32(checkpoint, tmp_path / "b", stages=2)
    assert read_manifest(bundle).tokenizer is None
    assert "no tokenizer" in caplog.text


@pytest.mark.parametrize("tied", [True, False])
def test_each_stage_reads_only_its_own_tensors(tmp_path: Path, tied: bool) -> None:
    """Tracing a stage loads its layers, plus the embedding only in stage 0 and norm + head only in the last."""
    checkpoint = write_checkpoint(tmp_path / "ckpt", llama_config(tie_word_embeddings=tied, num_hidden_layers=6))
    for index, (start, end) in enumerate([(0, 2), (2, 4), (4, 6)]):
        ckpt = open_checkpoint(checkpoint)
        dims = ckpt.dims
        trace_stage(ckpt, StageSpec(index, 3, start, end))
        expected = {n for i in range(start, end) for n in layer_tensors(ckpt.spec, dims, i)}
        if index == 0:
            expected.add(ckpt.spec.embed)
        if index == 2:
            expected |= {ckpt.spec.final_norm, ckpt.spec.embed if tied else ckpt.spec.lm_head}
        assert set(ckpt.loaded) == expected, f"stage {index}"


def test_one_stage_bundle_runs_in_openvino_genai(stories: Path, tmp_path: Path) -> None:
    """openvino_genai.LLMPipeline loads a one-stage bundle and its greedy tokens equal ovshard's own run."""
    import openvino_genai

    bundle = compile_fp32(stories, tmp_path / "b", stages=1)
    prompt = [1, 403, 407, 261, 378]
    ours, _ = run_greedy(bundle, prompt, 32)
    pipe = openvino_genai.LLMPipeline(str(bundle), "CPU", ATTENTION_BACKEND="SDPA",
                                      INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = 32
    config.do_sample = False
    result = pipe.generate(ov.Tensor(np.array([prompt], dtype=np.int64)), config)
    assert list(result.tokens[0]) == ours


def test_compiling_a_stage_frees_its_weights(tmp_path: Path) -> None:
    """Every tensor a stage loaded is garbage once its IR is saved: compile memory follows one stage."""
    import gc
    import weakref

    from ovshard.compile import CompileConfig, compile_stage
    from ovshard.passes import WeightFormat

    checkpoint = write_checkpoint(tmp_path / "ckpt", llama_config())
    ckpt = open_checkpoint(checkpoint)
    refs: list[weakref.ref] = []
    load = ckpt.load

    def recording_load(name: str):
        tensor = load(name)
        refs.append(weakref.ref(tensor))
        return tensor

    ckpt.load = recording_load  # type: ignore[method-assign]
    config = CompileConfig(checkpoint, tmp_path / "out", weights=WeightFormat("fp32"))
    compile_stage(ckpt, StageSpec(0, 2, 0, 2), config, 64, tmp_path)
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert refs and not alive, f"{len(alive)} of {len(refs)} loaded tensors are still alive"


def test_skip_passes_drops_a_pass_and_refuses_unknown_names(stories: Path, tmp_path: Path) -> None:
    """CompileConfig.skip_passes (benchmark A/B): without the Gather pass there is no beam_idx input
    and the pass log has no entry for it; a name the pipeline lacks is refused, naming the known ones."""
    from ovshard.compile import CompileConfig
    from ovshard.passes import WeightFormat

    out = compile_fp32(stories, tmp_path / "nogather", stages=1, skip_passes=("InjectBeamIdxGatherPass",))
    m = read_manifest(out)
    assert names.BEAM_IDX not in [i.name for i in m.stages[0].inputs]
    assert "InjectBeamIdxGatherPass" not in (out / "manifest.json").read_text()
    with pytest.raises(ValueError, match="MakeStatefulKVPass"):
        CompileConfig(stories, tmp_path / "x", weights=WeightFormat("fp32"), skip_passes=("NoSuchPass",))
