"""GGUF files compiled end to end (``ovshard compile model.gguf``): the real Gemma 3 270M (Q4_K_M), and a tiny
Mixtral and gpt-oss written as llama.cpp writes them, against transformers on the checkpoints they came from.

fp32 bundles of 2 and 3 stages must reproduce transformers run on the same GGUF (float32, eager
attention) token for token, logits within 1e-4. The default INT4 bundle re-quantizes weights that are
already 4-5 bit: its greedy agreement and perplexity against the fp32 bundle are printed (run with -s)
and held to sanity bounds only. The reference model is transformers' reading of the GGUF, saved once
(:func:`real_gemma.gemma_hf_reference_path`); the compiles share one layer cache, so the 3-stage
compile reuses the 2-stage compile's layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_greedy_like_hf, compile_fp32
from families import Family, write_random_checkpoint
from moe_gguf import gpt_oss_config, mixtral_config, write_gpt_oss_gguf, write_mixtral_gguf
from real_gemma import gemma_gguf, gemma_hf_reference  # noqa: F401  (fixtures)

from ovshard.bundle.manifest import read_manifest
from ovshard.bundle.weights import WeightFormat
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS

pytestmark = pytest.mark.slow


PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]  # "The capital of France is", bos first
NEW_TOKENS = 24
MAX_LOGIT_DIFF = 1e-4
MAX_POSITIONS = 256
TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally nicknamed "
    "the Iron Lady, it was constructed as the centrepiece of the 1889 World's Fair, and to crown the centennial "
    "anniversary of the French Revolution."
)


@pytest.fixture(scope="module")
def layer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-layer-cache")


@pytest.fixture(scope="module")
def hf_model(gemma_hf_reference: Path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_hf_reference, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens after PROMPT_IDS and the logits row that chose each."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack([row[0] for row in out.logits]).numpy()
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 10 * MAX_LOGIT_DIFF, "near-tie in the reference: token equality proves nothing"
    return out.sequences[0, len(PROMPT_IDS):].tolist(), logits


def compile_gguf(source: Path, output: Path, cache: Path, stages: int, weights: str | None = None) -> Path:
    fmt = WeightFormat(weights) if weights else WeightFormat()
    compile_bundle(CompileConfig(source, output, stages=stages, weights=fmt, max_positions=MAX_POSITIONS,
                                 cache_dir=cache))
    return output


def text_ids(reference: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(reference)(TEXT).input_ids


def teacher_forced(bundle: Path, ids: list[int], hints: dict[str, str] | None) -> np.ndarray:
    """The bundle's logits at every position of ``ids``, fed at once: [T, vocab]."""
    logits, _ = LocalPipeline(bundle, config=hints).forward(ids)
    return logits


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp(mean negative log-likelihood of ids[1:] under logits[:-1])."""
    x = logits[:-1].astype(np.float64)
    log_z = np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1)) + x.max(axis=1)
    return float(np.exp(np.mean(log_z - x[np.arange(len(x)), ids[1:]])))


@pytest.fixture(scope="module")
def fp32_two_stages(gemma_gguf: Path, layer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return compile_gguf(gemma_gguf, tmp_path_factory.mktemp("fp32") / "bundle", layer_cache, 2, "fp32")


def test_fp32_two_stages_match_transformers(fp32_two_stages: Path, hf_greedy: tuple[list[int], np.ndarray]) -> None:
    """A 2-stage fp32 bundle of the GGUF greedy-decodes transformers' 24 tokens, logits within 1e-4."""
    tokens, rows = LocalPipeline(fp32_two_stages, config=EXACT_HINTS).generate_greedy(PROMPT_IDS, NEW_TOKENS)
    assert tokens == hf_greedy[0]
    assert float(np.abs(np.stack(rows) - hf_greedy[1]).max()) <= MAX_LOGIT_DIFF


def test_three_stages_match_transformers(gemma_gguf: Path, layer_cache: Path, tmp_path: Path,  # noqa: F811
                                         hf_greedy: tuple[list[int], np.ndarray], fp32_two_stages: Path) -> None:
    """A 3-stage fp32 bundle (its layers from the 2-stage compile's cache) decodes the same tokens."""
    bundle = compile_gguf(gemma_gguf, tmp_path / "bundle", layer_cache, 3, "fp32")
    assert read_manifest(bundle).num_stages == 3
    tokens, rows = LocalPipeline(bundle, config=EXACT_HINTS).generate_greedy(PROMPT_IDS, NEW_TOKENS)
    assert tokens == hf_greedy[0]
    assert float(np.abs(np.stack(rows) - hf_greedy[1]).max()) <= MAX_LOGIT_DIFF


def test_bundle_tokenizer_from_gguf(fp32_two_stages: Path) -> None:
    """The bundle carries the GGUF's tokenizer as OpenVINO models that encode the prompt as transformers does."""
    import openvino as ov
    import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)

    manifest = read_manifest(fp32_two_stages)
    assert manifest.tokenizer is not None, "compile wrote no tokenizer for the GGUF"
    tokenizer = ov.Core().compile_model(fp32_two_stages / manifest.tokenizer.tokenizer)
    assert tokenizer(["The capital of France is"])["input_ids"][0].tolist() == PROMPT_IDS


@pytest.fixture(scope="module")
def default_two_stages(gemma_gguf: Path, layer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return compile_gguf(gemma_gguf, tmp_path_factory.mktemp("default") / "bundle", layer_cache, 2)


def test_int4_requantized_gguf_agreement(default_two_stages: Path, gemma_hf_reference: Path,  # noqa: F811
                                         fp32_two_stages: Path, hf_greedy: tuple[list[int], np.ndarray]) -> None:
    """The default INT4 compile of the Q4_K_M file: greedy agreement and perplexity against fp32 (reported)."""
    bundle = default_two_stages
    assert read_manifest(bundle).weights.mode != "fp32"
    # greedy agreement as `ovshard verify` counts it: top-1 along the fp32 greedy continuation, teacher-forced
    sequence = PROMPT_IDS + hf_greedy[0]
    steps = range(len(PROMPT_IDS) - 1, len(sequence) - 1)
    int4_greedy = teacher_forced(bundle, sequence, None)
    greedy = float(np.mean([int4_greedy[t].argmax() == sequence[t + 1] for t in steps]))
    ids = text_ids(gemma_hf_reference)
    exact, int4 = teacher_forced(fp32_two_stages, ids, EXACT_HINTS), teacher_forced(bundle, ids, None)
    top1 = float(np.mean(exact.argmax(axis=1) == int4.argmax(axis=1)))
    fp32_ppl, int4_ppl = perplexity(exact, ids), perplexity(int4, ids)
    print(f"\nINT4 of the Q4_K_M GGUF vs fp32: greedy top-1 agreement {greedy:.1%} over {NEW_TOKENS} tokens; "
          f"on {len(ids)} tokens of text top-1 agreement {top1:.1%}, perplexity {int4_ppl:.2f} (fp32 {fp32_ppl:.2f})")
    assert greedy >= 0.5 and top1 >= 0.5 and int4_ppl < 3 * fp32_ppl  # sanity only: re-quantizing compounds the error


COPY_TEXT = ("Copy the list exactly.\nList: apples, pears, plums, cherries, figs, dates, limes, kiwis, grapes, "
             "melons.\nCopy: apples, pears, plums,")


def test_speculative_greedy_equals_plain_greedy_on_the_default_compile(default_two_stages: Path,
                                                                        gemma_hf_reference: Path) -> None:  # noqa: F811
    """The real Gemma, default (compressed) compile, --exact hints (f32 compute and KV cache, no dynamic
    quantization: a multi-token verify step then scores each row as a one-token step does, to ~4e-5):
    prompt-lookup speculation gives plain greedy's tokens, 5 runs in a row, and drafts were accepted.
    Under default hints rows of a multi-token step differ from one-token steps (u8 KV cache, bf16,
    dynamic quantization; docs/speculation.md), so greedy can part at near-ties there."""
    from transformers import AutoTokenizer

    from ovshard.runtime.decoding.decode import Stats
    from ovshard.runtime.decoding.speculative import make_speculation
    from ovshard.runtime.engine.sampler import SamplingConfig

    ids = AutoTokenizer.from_pretrained(gemma_hf_reference)(COPY_TEXT).input_ids
    pipe = LocalPipeline(default_two_stages, config=EXACT_HINTS)
    config = SamplingConfig(max_tokens=40)
    plain = list(pipe.generate(ids, config))
    spec = make_speculation("prompt-lookup", "auto", pipe.manifest)
    runs, accepted = [], []
    for _ in range(5):
        stats = Stats()
        runs.append(list(pipe.generate(ids, config, stats, spec)))
        accepted.append(stats.accepted)
    assert all(run == plain for run in runs), (plain, runs)
    assert min(accepted) > 0, accepted


def test_mixtral_gguf_two_stages_match_its_checkpoint(tmp_path: Path) -> None:
    """An F32 Mixtral GGUF ("llama" with stacked experts) compiled to 2 fp32 stages greedy-decodes the tokens
    transformers decodes from the safetensors checkpoint it was converted from, logits within 1e-4."""
    checkpoint = write_random_checkpoint(Family(mixtral_config), tmp_path / "hf")
    bundle = compile_fp32(write_mixtral_gguf(checkpoint, tmp_path / "mixtral.gguf"), tmp_path / "bundle", stages=2)
    assert read_manifest(bundle).num_stages == 2
    prompt = [1, 17, 42, 99, 5, 123, 77]
    assert_greedy_like_hf(bundle, checkpoint, prompt, max_logit_diff=MAX_LOGIT_DIFF)


def test_gpt_oss_gguf_two_stages_match_its_checkpoint(tmp_path: Path) -> None:
    """An F32 gpt-oss GGUF (experts split and transposed, sinks, alternating sliding layers, yarn) compiled to 2 fp32
    stages greedy-decodes the tokens transformers decodes from its source checkpoint, past the 8-token window."""
    checkpoint = write_random_checkpoint(Family(gpt_oss_config, seed=3), tmp_path / "hf")
    bundle = compile_fp32(write_gpt_oss_gguf(checkpoint, tmp_path / "gpt-oss.gguf"), tmp_path / "bundle", stages=2,
                          max_positions=256)
    prompt = [1, 17, 42, 99, 5, 123, 77]
    assert_greedy_like_hf(bundle, checkpoint, prompt, max_logit_diff=MAX_LOGIT_DIFF)
