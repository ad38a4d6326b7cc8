"""Paged stages (runtime/engine/paged.py): a bundle stage converted to paged attention when loaded.

The real stories260K model as a 2-stage fp32 bundle, compiled with exact f32 hints. Block tables come from one
BlockManager per stage (runtime/scheduling/block_tables.py), given the same calls as a head would give every stage; the
stateful path (``run_greedy``) is the reference for tokens and logits.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from conftest import compile_fp32, run_greedy

from ovshard.bundle.manifest import read_manifest
from ovshard.errors import BundleError, PagedUnsupportedError
from ovshard.runtime.engine.paged import PagedRows, PagedStage, compile_paged
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.runtime.scheduling.block_tables import BlockManager, Granted

NUM_BLOCKS = 24
TOL = 1e-4
_rng = np.random.default_rng(7)
LONG = [1, *_rng.integers(3, 500, 80).tolist()]  # a prompt of 81 ids: sequences below take prefixes of it


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("paged") / "bundle", stages=2)


@pytest.fixture(scope="module")
def stages(bundle: Path) -> list[PagedStage]:
    """Both stages in paged form; the last computes the logit rows each sequence wants."""
    manifest, core = read_manifest(bundle), ov.Core()
    return [compile_paged(core, bundle, manifest, i, config=EXACT_HINTS, num_blocks=NUM_BLOCKS, slice_logits=True)
            for i in range(manifest.num_stages)]


class Pipeline:
    """Both paged stages, each with its own block manager, driven as a head drives a pipeline: every manager
    gets the same calls and must grant the same tables (the keys come from the token ids alone)."""

    def __init__(self, stages: list[PagedStage]) -> None:
        self.stages = stages
        self.managers = [BlockManager(NUM_BLOCKS, s.block_size, s.bytes_per_token) for s in stages]

    def step(self, work: dict[str, list[int]], want: int = 1) -> dict[str, np.ndarray]:
        """One tick: each sequence's new ids (a new sequence: its prompt) through every stage in one call each;
        returns each sequence's last ``want`` logits rows."""
        seqs, rows = list(work), []
        for seq in seqs:
            start = self.managers[0].length(seq) if seq in self.managers[0] else None
            grants = [m.allocate(seq, work[seq]) if start is None else m.append(seq, work[seq])
                      for m in self.managers]
            assert isinstance(grants[0], Granted) and all(g == grants[0] for g in grants), grants
            for stage, grant in zip(self.stages, grants, strict=True):
                stage.copy_blocks(grant.copies)
            position = grants[0].cached if start is None else start
            ids = work[seq][position:] if start is None else work[seq]
            rows.append(PagedRows(np.array(ids, np.int64), position, grants[0].blocks))
        for i, stage in enumerate(self.stages):
            last = i == len(self.stages) - 1
            outs = stage.run([PagedRows(r.x, r.position, r.blocks, min(want, r.count) if last else None)
                              for r in rows])
            rows = [PagedRows(x, r.position, r.blocks) for x, r in zip(outs, rows, strict=True)]
        for manager in self.managers:
            for seq in seqs:
                manager.commit(seq)
        return {seq: r.x for seq, r in zip(seqs, rows, strict=True)}

    def greedy(self, prompts: dict[str, list[int]], steps: int) -> dict[str, tuple[list[int], np.ndarray]]:
        """Prefill every prompt in one tick, then ``steps`` decode ticks with every sequence's row in each."""
        logits = self.step(prompts)
        tokens: dict[str, list[int]] = {seq: [] for seq in prompts}
        rows: dict[str, list[np.ndarray]] = {seq: [] for seq in prompts}
        for tick in range(steps + 1):
            for seq, out in logits.items():
                rows[seq].append(out[-1])
                tokens[seq].append(int(np.argmax(out[-1])))
            if tick < steps:
                logits = self.step({seq: [tokens[seq][-1]] for seq in prompts})
        return {seq: (tokens[seq], np.stack(rows[seq])) for seq in prompts}


def assert_matches(found: tuple[list[int], np.ndarray], expected: tuple[list[int], np.ndarray]) -> None:
    assert found[0] == expected[0]
    np.testing.assert_allclose(found[1], expected[1], atol=TOL, rtol=0)


def test_runtime_graph_has_one_paged_attention_per_layer(bundle: Path, stages: list[PagedStage]):
    """The CPU plugin runs each converted stage with one PagedAttention node a layer and no KV state."""
    manifest = read_manifest(bundle)
    for entry, stage in zip(manifest.stages, stages, strict=True):
        runtime = stage.compiled.get_runtime_model()
        kinds = Counter(op.get_rt_info()["layerType"].astype(str) for op in runtime.get_ops())
        assert kinds["PagedAttention"] == len(entry.stage.layers), kinds
        assert not {"MemoryInput", "MemoryOutput", "ReadValue", "Assign", "ScaledDotProductAttention"} & set(kinds)


def test_caches_follow_the_plugin_layout(bundle: Path, stages: list[PagedStage]):
    """Caches are [blocks, kv_heads, 32, head_dim] f32 under f32 hints; bytes per token count each layer's K and V."""
    arch = read_manifest(bundle).architecture
    for stage, layers in zip(stages, (3, 2), strict=True):
        assert stage.block_size == 32 and len(stage.specs) == 2 * layers
        for spec in stage.specs:
            assert stage.cache(spec.name).shape == (NUM_BLOCKS, arch.num_kv_heads, 32, arch.head_dim)
            assert stage.cache(spec.name).dtype == np.float32
        assert stage.bytes_per_token == layers * 2 * arch.num_kv_heads * arch.head_dim * 4


def test_one_sequence_matches_the_stateful_path(bundle: Path, stages: list[PagedStage]):
    """A 7-token prefill and 5 greedy decode steps give run_greedy's tokens and logits."""
    prompt = [1, 403, 407, 261, 378, 395, 300]
    found = Pipeline(stages).greedy({"a": prompt}, steps=5)["a"]
    assert_matches(found, run_greedy(bundle, prompt, 6))


def test_warming_at_load_leaves_no_trace(bundle: Path):
    """compile_paged warms each stage (a 2-token and a 1-token step on block 0, so the plugin prepares its prompt
    kernels at load); a sequence whose table starts at that block gets the outputs of stages that never ran."""
    manifest, core = read_manifest(bundle), ov.Core()
    warmed = [compile_paged(core, bundle, manifest, i, config=EXACT_HINTS, num_blocks=NUM_BLOCKS, slice_logits=True)
              for i in range(manifest.num_stages)]
    assert any(np.any(s.cache(s.specs[0].name)[0]) for s in warmed)  # block 0 holds the warm-up's keys
    never_ran = [PagedStage(s.compiled, s.primary, NUM_BLOCKS, s.max_positions, s.sliced) for s in warmed]
    prompt = [1, 403, 407, 261, 378]
    assert_matches(Pipeline(warmed).greedy({"a": prompt}, steps=3)["a"],
                   Pipeline(never_ran).greedy({"a": prompt}, steps=3)["a"])


def test_batched_sequences_each_get_their_solo_output(bundle: Path, stages: list[PagedStage]):
    """Three prompts of different lengths, prefilled in one call and decoded with all three rows in each call,
    each give exactly the tokens (and the logits) of running alone."""
    prompts = {"a": LONG[:5], "b": LONG[:19], "c": LONG[:45]}  # c spans two blocks and decodes on
    found = Pipeline(stages).greedy(prompts, steps=6)
    for seq, prompt in prompts.items():
        assert_matches(found[seq], run_greedy(bundle, prompt, 7))


def test_shared_prefix_blocks_are_reused(bundle: Path, stages: list[PagedStage]):
    """A second sequence with the first's 64-id prefix reuses its two full blocks and prefills only the rest,
    with the tokens of prefilling it whole."""
    pipe = Pipeline(stages)
    pipe.step({"a": LONG[:70]})
    second = LONG[:64] + [300, 301, 302, 303, 304]
    found = pipe.greedy({"b": second}, steps=4)["b"]
    for manager in pipe.managers:
        assert manager.stats.hit_tokens == 64  # b prefilled positions 64..68 only (past_lens 64)
        assert manager.blocks("b")[:2] == manager.blocks("a")[:2] and manager.refs(manager.blocks("a")[0]) == 2
    assert_matches(found, run_greedy(bundle, second, 5))


def test_rewind_by_block_table_is_exact(bundle: Path, stages: list[PagedStage]):
    """After a step of K+1 rows (a token and 3 wrong drafts crossing into a new block), truncating the drafts
    frees the emptied block, and decoding on gives the tokens of a run that never saw them."""
    prompt = LONG[:30]
    expected = run_greedy(bundle, prompt, 6)
    pipe = Pipeline(stages)
    first = int(np.argmax(pipe.step({"a": prompt})["a"][-1]))
    verify = pipe.step({"a": [first, 7, 8, 9]}, want=4)["a"]  # positions 30..33: block 1 holds 32, 33
    assert int(np.argmax(verify[0])) == expected[0][1]
    for manager in pipe.managers:
        assert len(manager.truncate("a", 31)) == 1 and len(manager.blocks("a")) == 1
    tokens, rows = [first, expected[0][1]], [verify[0]]
    for _ in range(4):
        out = pipe.step({"a": [tokens[-1]]})["a"][-1]
        tokens.append(int(np.argmax(out)))
        rows.append(out)
    assert tokens == expected[0]
    np.testing.assert_allclose(np.stack(rows), expected[1][1:], atol=TOL, rtol=0)


def test_forked_sequences_copy_the_shared_block(bundle: Path, stages: list[PagedStage]):
    """Two continuations of one prefilled prompt (fork) write into copies of its partial last block: each gives the
    tokens of its own whole prompt run alone."""
    prompt = LONG[:40]
    pipe = Pipeline(stages)
    pipe.step({"a": prompt})
    for manager in pipe.managers:
        manager.fork("a", "b")
    out = pipe.step({"a": [11], "b": [12]})
    found = {"a": out["a"][-1], "b": out["b"][-1]}
    for seq, extra in (("a", 11), ("b", 12)):
        expected = run_greedy(bundle, [*prompt, extra], 1)
        np.testing.assert_allclose(found[seq], expected[1][0], atol=TOL, rtol=0)


def test_sliced_rows_equal_full_rows(bundle: Path, stages: list[PagedStage]):
    """The sliced last stage's wanted rows equal the same rows of a last stage computing every row."""
    manifest = read_manifest(bundle)
    full = compile_paged(ov.Core(), bundle, manifest, 1, config=EXACT_HINTS, num_blocks=NUM_BLOCKS)
    hidden = stages[0].run([PagedRows(np.array(LONG[:9], np.int64), 0, [0]),
                            PagedRows(np.array(LONG[:4], np.int64), 0, [1])])
    every = full.run([PagedRows(hidden[0], 0, [0]), PagedRows(hidden[1], 0, [1])])
    some = stages[1].run([PagedRows(hidden[0], 0, [0], want=3), PagedRows(hidden[1], 0, [1], want=1)])
    assert [r.shape for r in some] == [(3, manifest.architecture.vocab_size), (1, manifest.architecture.vocab_size)]
    np.testing.assert_array_equal(some[0], every[0][-3:])
    np.testing.assert_array_equal(some[1], every[1][-1:])


def test_bad_block_tables_are_refused(stages: list[PagedStage]):
    """Block ids outside the pool, too few blocks, or two sequences writing one block are refused before the kernel
    reads or writes them."""
    ids = np.array(LONG[:5], np.int64)
    with pytest.raises(BundleError, match=r"block ids in \[0, 24\)"):
        stages[0].run([PagedRows(ids, 0, [NUM_BLOCKS])])
    with pytest.raises(BundleError, match="expected 2 block ids"):
        stages[0].run([PagedRows(ids, 30, [0])])
    with pytest.raises(BundleError, match="another sequence of the step writes"):
        stages[0].run([PagedRows(ids, 0, [3]), PagedRows(ids, 0, [3])])


def _tiny_bundle(tmp_path: Path, config_class: str, **extra: object) -> Path:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, config_class)(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=128, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "checkpoint")
    return compile_fp32(tmp_path / "checkpoint", tmp_path / "bundle", stages=2)


def test_a_soft_capped_stage_is_refused(tmp_path: Path):
    """A stage whose attention the transformation cannot match (Gemma 2's soft-capped scores) is refused with
    PagedUnsupportedError (the caller runs it stateful), never converted into wrong numbers."""
    bundle = _tiny_bundle(tmp_path, "Gemma2Config", attn_logit_softcapping=50.0, sliding_window=8)
    with pytest.raises(PagedUnsupportedError, match="No ScaledDotProductAttention"):
        compile_paged(ov.Core(), bundle, read_manifest(bundle), 0, num_blocks=4)


def test_a_chunked_attention_stage_is_refused(tmp_path: Path):
    """Llama 4's chunked attention has no PagedAttention form (a sliding window is not a chunk): every stage of such
    a model is refused by name, so the caller runs it stateful rather than attending across chunk boundaries."""
    bundle = _tiny_bundle(tmp_path, "Llama4TextConfig", intermediate_size_mlp=48, num_local_experts=2,
                          attention_chunk_size=8, no_rope_layer_interval=2)
    manifest = read_manifest(bundle)
    for index in range(2):
        with pytest.raises(PagedUnsupportedError, match=r"chunked attention \(attention_chunk_size=8"):
            compile_paged(ov.Core(), bundle, manifest, index, num_blocks=4)


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_sliding_window_layers_keep_their_windows(tmp_path: Path, family: str):
    """Sliding-window layers (Mistral: all, window 8; Gemma 3: local and global layers, local rope) run paged
    with their windows: a 45-token prompt and 12 decode steps over 2 stages, several sequences in each tick,
    give the stateful path's tokens and logits."""
    from families import FAMILIES, write_random_checkpoint

    checkpoint = write_random_checkpoint(FAMILIES[family], tmp_path / "checkpoint")
    bundle = compile_fp32(checkpoint, tmp_path / "bundle", stages=2)
    manifest, core = read_manifest(bundle), ov.Core()
    paged = [compile_paged(core, bundle, manifest, i, config=EXACT_HINTS, num_blocks=NUM_BLOCKS, slice_logits=True)
             for i in range(2)]
    rng = np.random.default_rng(3)
    prompts = {f"s{i}": [1, *(int(t) for t in rng.integers(3, 300, 44 - 7 * i))] for i in range(3)}
    found = Pipeline(paged).greedy(prompts, 12)
    for seq, prompt in prompts.items():
        assert_matches(found[seq], run_greedy(bundle, prompt, 13))


@pytest.mark.parametrize(("mla_cache", "heads", "widths"), [("latent", 1, (24, 16)), ("expanded", 4, (24, 12))])
def test_latent_attention_runs_paged_with_caches_of_two_widths(tmp_path: Path, mla_cache: str, heads: int,
                                                              widths: tuple[int, int]):
    """DeepSeek-V3's multi-head latent attention converts to paged attention with a key cache and a value cache of
    their own widths: the latent cache one head of keys [latent 16; rotary key 8] and values the latent (16), the
    expanded one 4 heads of keys 16 + 8 and values 12; several sequences in a tick over 2 stages give the stateful
    path's tokens and logits."""
    from families import FAMILIES, write_random_checkpoint

    checkpoint = write_random_checkpoint(FAMILIES["deepseek_v3"], tmp_path / "checkpoint")
    bundle = compile_fp32(checkpoint, tmp_path / "bundle", stages=2, mla_cache=mla_cache)
    manifest, core = read_manifest(bundle), ov.Core()
    paged = [compile_paged(core, bundle, manifest, i, config=EXACT_HINTS, num_blocks=NUM_BLOCKS, slice_logits=True)
             for i in range(2)]
    for stage in paged:
        found = {stage.cache(spec.name).shape[1:] for spec in stage.specs}
        assert found == {(heads, 32, widths[0]), (heads, 32, widths[1])}, found
        assert stage.bytes_per_token == len(stage.specs) // 2 * heads * sum(widths) * 4
    rng = np.random.default_rng(5)
    prompts = {f"s{i}": [1, *(int(t) for t in rng.integers(3, 300, 40 - 9 * i))] for i in range(3)}
    found_ids = Pipeline(paged).greedy(prompts, 10)
    for seq, prompt in prompts.items():
        assert_matches(found_ids[seq], run_greedy(bundle, prompt, 11))
