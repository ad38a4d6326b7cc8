"""Bundles compiled with fp32 weights and run stage by stage match Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import compile_fp32, hf_greedy, run_greedy

from ovshard.tools.synth import llama_config, write_checkpoint

pytestmark = pytest.mark.slow


NEW_TOKENS = 32
MAX_LOGIT_DIFF = 1e-4


def assert_matches_hf(checkpoint: Path, bundle: Path, prompt: list[int]) -> float:
    ref_tokens, ref_logits = hf_greedy(checkpoint, prompt, NEW_TOKENS)
    tokens, logits = run_greedy(bundle, prompt, NEW_TOKENS)
    diff = float(np.abs(logits - ref_logits).max())
    first_bad = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), None)
    assert tokens == ref_tokens, f"greedy tokens diverge from HF at step {first_bad}"
    assert diff <= MAX_LOGIT_DIFF, f"max |logit diff| {diff:.2e} > {MAX_LOGIT_DIFF:.0e}"
    print(f"{bundle.parent.name}: {NEW_TOKENS}/{NEW_TOKENS} greedy tokens equal, max |logit diff| {diff:.2e}")
    return diff


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_stories_matches_hf_for_every_stage_count(stories: Path, tmp_path: Path, stages: int) -> None:
    """stories260K split into 1..5 stages (one stage per layer at 5) matches HF logits and 32 greedy tokens."""
    bundle = compile_fp32(stories, tmp_path / "b", stages=stages)
    assert_matches_hf(stories, bundle, [1, 403, 407, 261, 378])


RANDOM_CASES = {
    # llama3 rope scaling (transformers 5 rope_parameters), GQA, untied: the synth default
    "llama3_rope_gqa_untied": dict(config=llama_config(), stages=2),
    # the same rope written with the legacy rope_scaling key
    "legacy_rope_scaling_key": dict(
        config=llama_config(rope_parameters=None, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        stages=2),
    # yarn: attention scaling != 1 multiplies cos/sin
    "yarn_rope": dict(config=llama_config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}),
        stages=2),
    # head_dim (32) different from hidden / heads (64 / 4 = 16), tied embeddings
    "head_dim_differs_tied": dict(config=llama_config(head_dim=32, tie_word_embeddings=True), stages=3),
    # MHA with attention and MLP biases
    "mha_with_biases": dict(config=llama_config(num_key_value_heads=4, attention_bias=True, mlp_bias=True),
                            stages=2),
    # odd layer count split unevenly by explicit ranges
    "seven_layers_uneven": dict(config=llama_config(num_hidden_layers=7), layers=((0, 1), (1, 5), (5, 7))),
}


@pytest.mark.parametrize("case", sorted(RANDOM_CASES))
def test_random_checkpoint_matches_hf(tmp_path: Path, case: str) -> None:
    """Random-weight Llama variants compiled to stages match HF logits (<= 1e-4) and 32 greedy tokens."""
    spec = dict(RANDOM_CASES[case])
    checkpoint = write_checkpoint(tmp_path / "ckpt", spec.pop("config"), seed=3)
    if "layers" in spec:
        spec["layers"] = tuple(spec["layers"])
    bundle = compile_fp32(checkpoint, tmp_path / "b", **spec)
    assert_matches_hf(checkpoint, bundle, [1, 17, 42, 99, 5, 200])
