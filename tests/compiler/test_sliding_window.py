"""Sliding-window attention with holes in the KV cache: speculative rewinds keep results exact.

A sliding layer's window counts the positions the mask shows, not cache slots, so the holes that
rejected drafts leave (mask zeros) must never shorten it. Tiny random Mistral (every layer slides) and
Gemma 3 text (sliding and full layers mixed) checkpoints, window 8, runs several windows long, checked
against Hugging Face (eager attention) and against plain greedy decoding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from ovshard.bundle.weights import WeightFormat
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import PromptLookup, Speculation
from ovshard.runtime.engine.kv import CompactionPolicy
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.stage import EXACT_HINTS

WINDOW = 8
VOCAB = 300
NEW_TOKENS = 64  # 8 windows
PROMPT = [1, 17, 42, 9, 100, 17, 42, 9, 100, 17]  # repetitive, so prompt lookup drafts from the start
COMMON = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
              initializer_range=0.2, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# family: (config class, its extra keys, weight seed). Seeds and untied Gemma embeddings chosen so greedy
# text keeps changing for all 64 tokens (a tied random Gemma repeats one token, which no mask bug can move).
FAMILIES = {
    "mistral": ("MistralConfig", {}, 0),
    "gemma3_text": ("Gemma3TextConfig", {
        "layer_types": ["sliding_attention", "full_attention"] * 2, "tie_word_embeddings": False,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}, 1),
}


def _hf_model(checkpoint: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()


def _write_checkpoint(family: str, path: Path) -> Path:
    """Random weights, norm scales perturbed too (so every weight matters), saved with save_pretrained."""
    config_class, extra, seed = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma scales by (1 + w), the others by w
                p.normal_(0.0 if family.startswith("gemma") else 1.0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A family's checkpoint, its two-stage fp32 bundle, and the Hugging Face greedy reference."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    checkpoint = _write_checkpoint(family, root / "ckpt")
    bundle = root / "bundle"
    compile_bundle(CompileConfig(checkpoint=checkpoint, output=bundle, stages=2, weights=WeightFormat("fp32"),
                                 max_positions=256))
    hf = _hf_model(checkpoint)
    generation = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), generation_config=generation)
    hf_tokens = out[0, len(PROMPT):].tolist()
    assert len(hf_tokens) == NEW_TOKENS
    pipe = LocalPipeline(bundle, config=EXACT_HINTS, verify=False)
    plain = list(pipe.generate(PROMPT, SamplingConfig(max_tokens=NEW_TOKENS)))
    return {"family": family, "hf": hf, "bundle": bundle, "pipe": pipe, "hf_tokens": hf_tokens, "plain": plain}


class CorruptedOracle:
    """Drafts the reference continuation with one token spoiled at a random place in most drafts.

    Greedy acceptance keeps the drafts before the spoiled one, so each step rewinds 0..K positions:
    accepted and hidden positions interleave in the cache, the holes a poor drafter leaves.
    """

    name = "corrupted-oracle"

    def __init__(self, reference: list[int], seed: int = 0) -> None:
        self.reference = reference  # prompt + the greedy continuation
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def fork(self) -> CorruptedOracle:
        return CorruptedOracle(self.reference, self.seed)

    def draft(self, context: list[int], k: int, config: SamplingConfig,
              rng: np.random.Generator) -> tuple[list[int], None]:
        drafts = list(self.reference[len(context):len(context) + k])
        spoil = int(self.rng.integers(0, k + 2))  # k or k + 1 (2 draws in k + 2): left whole
        if spoil < len(drafts):
            drafts[spoil] = (drafts[spoil] + 1 + int(self.rng.integers(VOCAB - 1))) % VOCAB
        return drafts, None


def _speculate(model: dict, drafter: str, policy: CompactionPolicy) -> tuple[list[int], Stats]:
    drafters = {"corrupted-oracle": lambda: CorruptedOracle(PROMPT + model["plain"]),
                "prompt-lookup": PromptLookup}
    stats = Stats()
    spec = Speculation(drafters[drafter](), 4, policy)
    got = list(model["pipe"].generate(PROMPT, SamplingConfig(max_tokens=NEW_TOKENS), stats, spec))
    return got, stats


def test_plain_greedy_equals_hugging_face(model: dict) -> None:
    """The bundle's plain greedy run, 8 windows long, is Hugging Face's greedy continuation."""
    assert model["plain"] == model["hf_tokens"]


@pytest.mark.parametrize("drafter", ["corrupted-oracle", "prompt-lookup"])
def test_speculative_greedy_with_holes_equals_plain_greedy(model: dict, drafter: str) -> None:
    """Rejected drafts leave holes inside the window; the tokens are still plain greedy and HF's."""
    got, stats = _speculate(model, drafter, CompactionPolicy(limit=256, min_holes=10_000))
    assert got == model["plain"] == model["hf_tokens"]
    assert 0 < stats.accepted < stats.drafted and stats.rewinds > 0 and stats.compactions == 0
    for stage in model["pipe"].stages:  # the holes are really in every stage's cache
        mask = stage.cache.mask
        # The last step's rejections (at most K = 4) would ride on a next step that never comes.
        assert stats.rewound_positions - 4 <= mask.count(0) <= stats.rewound_positions
        assert 0 in mask[len(PROMPT):-WINDOW]  # holes well behind the newest window, not only at its end


def test_speculative_greedy_with_frequent_compaction_equals_plain_greedy(model: dict) -> None:
    """Compaction every few holes (the physical path) interleaved with mask rewinds: still exact."""
    got, stats = _speculate(model, "corrupted-oracle", CompactionPolicy(hole_share=0.02, min_holes=3, limit=256))
    assert got == model["plain"] == model["hf_tokens"]
    assert stats.compactions > 1 and stats.accepted < stats.drafted


def _stage_chain(pipe: LocalPipeline, tokens: list[int], position: int, rewind: int = 0) -> np.ndarray:
    """One step through every stage; returns the logits [T, vocab]."""
    x = np.array([tokens], dtype=np.int64)  # [1, T]
    for stage in pipe.stages:
        x = stage.step(x, position, rewind=rewind)
    return x[0]


def test_holes_equal_hugging_face_without_the_hole_tokens(model: dict) -> None:
    """Holes in the mask (cached tokens hidden by a rewind) read as if their tokens were never there."""
    rng = np.random.default_rng(1)
    pieces = [rng.integers(3, VOCAB, size=n).tolist() for n in (10, 3, 5, 4, 6, 2, 9)]  # visible, hole, ...
    pipe = model["pipe"]
    pipe.reset()
    visible, rows, pending_rewind = [], [], 0
    for i, piece in enumerate(pieces):
        position = len(visible)
        if i % 2:  # a hole: its tokens are cached and then rewound
            _stage_chain(pipe, piece, position)
            pending_rewind = len(piece)
            continue
        rows.append(_stage_chain(pipe, piece, position, rewind=pending_rewind))
        visible += piece
        pending_rewind = 0
    mask = pipe.stages[0].cache.mask
    assert mask.count(0) == 3 + 4 + 2 and mask.count(1) == len(visible) == 30  # ~4 windows, holes in each
    with torch.no_grad():
        ref = model["hf"](torch.tensor([visible])).logits[0].numpy()
    got = np.concatenate(rows)
    diff = np.abs(got - ref)
    assert float(diff.max()) <= 1e-4, f"max |diff| {diff.max():.2e} at visible position {diff.max(1).argmax()}"
