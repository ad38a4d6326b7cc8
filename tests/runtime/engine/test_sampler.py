"""The sampler: filters, seeded draws, stop rules and streaming detokenization, without sockets."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.stats import chisquare

from ovshard.runtime.client.text import IncrementalDetokenizer
from ovshard.runtime.decoding.decode import want_for
from ovshard.runtime.engine.sampler import (
    SamplingConfig,
    probabilities,
    sample,
    sample_from_topk,
    should_stop,
)
from ovshard.runtime.engine.scores import Scores

# Logit rows with ties (small integers), -inf entries and huge magnitudes; at least one finite entry.
ELEMENTS = st.one_of(st.integers(-3, 3).map(float), st.floats(-1e308, 1e308), st.just(-math.inf))
LOGITS = arrays(np.float64, st.integers(1, 40), elements=ELEMENTS).filter(lambda a: np.isfinite(a).any())
CONFIGS = st.builds(SamplingConfig, temperature=st.floats(1e-3, 100.0), top_k=st.integers(0, 50),
                    top_p=st.floats(1e-6, 1.0))


def row(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def kept(p: np.ndarray) -> list[int]:
    return np.flatnonzero(p).tolist()


# --- greedy and temperature -------------------------------------------------------------------------

@given(LOGITS, st.integers(0, 2**32))
def test_greedy_is_argmax_and_leaves_rng_untouched(logits: np.ndarray, seed: int) -> None:
    """Temperature 0 returns argmax (lowest id on ties) and draws nothing from the rng."""
    rng = np.random.default_rng(seed)
    before = rng.bit_generator.state
    assert sample(logits, SamplingConfig(top_k=3, top_p=0.5), rng) == int(np.argmax(logits))
    assert rng.bit_generator.state == before


def test_greedy_ties_pick_the_lowest_id() -> None:
    """Among equal maxima greedy picks the lowest token id, and probabilities() puts all mass there."""
    logits = row(0.0, 5.0, 1.0, 5.0)
    assert sample(logits, SamplingConfig(), np.random.default_rng(0)) == 1
    np.testing.assert_array_equal(probabilities(logits, SamplingConfig()), [0, 1, 0, 0])


def test_low_temperature_approaches_one_hot() -> None:
    """As T -> 0 the distribution concentrates on the argmax."""
    logits = row(1.0, 2.0, 1.5, -1.0)
    masses = [probabilities(logits, SamplingConfig(temperature=t))[1] for t in (1.0, 0.3, 0.1, 0.01)]
    assert masses == sorted(masses) and masses[-1] > 1 - 1e-12


def test_high_temperature_approaches_uniform() -> None:
    """As T grows the distribution approaches uniform over the vocabulary."""
    logits = row(1.0, 2.0, 1.5, -1.0, 0.0)
    p = probabilities(logits, SamplingConfig(temperature=1e6))
    np.testing.assert_allclose(p, np.full(5, 0.2), atol=1e-6)


def test_temperature_one_is_plain_softmax() -> None:
    """T = 1 without filters is softmax(logits)."""
    logits = row(0.5, -1.0, 2.0)
    expected = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(probabilities(logits, SamplingConfig(temperature=1.0)), expected, rtol=1e-12)


# --- top-k and top-p ---------------------------------------------------------------------------------

@given(arrays(np.float64, st.integers(1, 30), elements=st.integers(-2, 2).map(float)), st.integers(1, 40))
def test_top_k_keeps_exactly_k_best(logits: np.ndarray, k: int) -> None:
    """Top-k keeps exactly min(k, vocab) tokens, the largest logits, ties broken towards lower ids."""
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_k=k))
    best = sorted(range(logits.size), key=lambda i: (-logits[i], i))[:k]
    assert kept(p) == sorted(best)


def test_top_k_ties_keep_the_lowest_ids() -> None:
    """With three tokens tied for second place and k = 2, the tied token with the lowest id stays."""
    p = probabilities(row(1.0, 3.0, 2.0, 2.0, 2.0), SamplingConfig(temperature=1.0, top_k=2))
    assert kept(p) == [1, 2]


def test_top_p_hand_worked_nucleus() -> None:
    """probs [.1 .4 .3 .2]: p=.3 keeps {1}; p=.6 keeps {1,2} as 4/7, 3/7; p=.75 keeps {1,2,3} as 4/9, 3/9, 2/9."""
    logits = np.log(row(0.1, 0.4, 0.3, 0.2))
    p = [probabilities(logits, SamplingConfig(temperature=1.0, top_p=q)) for q in (0.3, 0.6, 0.75)]
    np.testing.assert_allclose(p[0], [0, 1, 0, 0])
    np.testing.assert_allclose(p[1], [0, 4 / 7, 3 / 7, 0])
    np.testing.assert_allclose(p[2], [0, 4 / 9, 3 / 9, 2 / 9])


def test_top_p_always_keeps_one_token() -> None:
    """A nucleus smaller than the most likely token's mass still keeps that token."""
    p = probabilities(row(0.0, 0.1, 0.0), SamplingConfig(temperature=1.0, top_p=1e-9))
    np.testing.assert_array_equal(p, [0, 1, 0])


@given(arrays(np.float64, st.integers(1, 30), elements=st.floats(-20, 20)), st.floats(1e-6, 0.999))
def test_top_p_keeps_the_smallest_nucleus(logits: np.ndarray, top_p: float) -> None:
    """The kept tokens are the most likely ones, hold mass >= p, and dropping the least of them falls below p."""
    full = probabilities(logits, SamplingConfig(temperature=1.0))
    nucleus = kept(probabilities(logits, SamplingConfig(temperature=1.0, top_p=top_p)))
    dropped = sorted(set(range(logits.size)) - set(nucleus))
    mass = full[nucleus].sum()
    assert mass >= top_p - 1e-12
    assert mass - full[nucleus].min() < top_p + 1e-12
    assert not dropped or full[nucleus].min() >= full[dropped].max()


def test_top_p_applies_to_what_top_k_left() -> None:
    """Top-p measures mass in the renormalized top-k distribution (the Hugging Face order)."""
    logits = np.log(row(0.4, 0.3, 0.2, 0.1))  # top-2 renormalized: 4/7 = 0.571, 3/7
    config = SamplingConfig(temperature=1.0, top_k=2, top_p=0.55)
    np.testing.assert_allclose(probabilities(logits, config), [1, 0, 0, 0])


@settings(max_examples=300)

def _reference_probabilities(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """`probabilities` as first written: the whole row ranked (ties: lower id first), then filtered."""
    ids = np.arange(logits.size)
    order = np.lexsort((ids, -logits))
    if config.greedy:
        out = np.zeros(logits.size)
        out[order[0]] = 1.0
        return out
    with np.errstate(over="ignore"):
        z = (logits - logits.max()) / config.temperature
    if config.top_k:
        order = order[: config.top_k]
    if config.top_p < 1:
        q = np.exp(z[order])
        n = int(np.searchsorted(np.cumsum(q / q.sum()), config.top_p, side="left")) + 1
        order = order[: min(n, order.size)]
    order = np.sort(order)
    out = np.zeros(logits.size)
    out[order] = np.exp(z[order]) / np.exp(z[order]).sum()
    return out


@given(arrays(np.float64, st.integers(1, 600), elements=st.one_of(st.integers(-4, 4).map(float),
                                                                  st.floats(-30.0, 30.0))),
       st.builds(SamplingConfig, temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]), top_k=st.integers(0, 700),
                 top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.05])))
@settings(max_examples=300, deadline=None)
def test_filters_rank_only_what_they_keep_and_keep_what_a_whole_sort_keeps(logits: np.ndarray,
                                                                          config: SamplingConfig) -> None:
    """The sampler ranks only the tokens top-k/top-p keep (a partial selection), and gives the distribution of
    ranking the whole row first, ties included (to float rounding of the top-p sums)."""
    np.testing.assert_allclose(probabilities(logits, config), _reference_probabilities(logits, config),
                               rtol=1e-12, atol=1e-15)

@given(LOGITS, CONFIGS)
def test_probabilities_are_a_distribution(logits: np.ndarray, config: SamplingConfig) -> None:
    """For any row, incl. -inf and huge logits: no NaN, non-negative, sums to 1, -inf entries get 0."""
    p = probabilities(logits, config)
    assert p.dtype == np.float64 and p.shape == logits.shape
    assert np.isfinite(p).all() and (p >= 0).all()
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    assert (p[np.isneginf(logits)] == 0).all()


@pytest.mark.parametrize("bad", [row(0.0, math.nan), row(0.0, math.inf), row(-math.inf, -math.inf),
                                 np.zeros((2, 3)), np.zeros(0)])
def test_unusable_logits_raise(bad: np.ndarray) -> None:
    """NaN, +inf, all -inf, and anything but one non-empty row are refused with a ValueError."""
    with pytest.raises(ValueError, match="logit"):
        sample(bad, SamplingConfig(temperature=1.0), np.random.default_rng(0))


# --- seeded draws ------------------------------------------------------------------------------------

def draws(logits: np.ndarray, config: SamplingConfig, seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [sample(logits, config, rng) for _ in range(n)]


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    """The same seed gives the same token sequence; another seed gives another."""
    logits, config = np.linspace(0, 1, 50), SamplingConfig(temperature=1.0)
    assert draws(logits, config, 7, 100) == draws(logits, config, 7, 100)
    assert draws(logits, config, 7, 100) != draws(logits, config, 8, 100)


def test_empirical_distribution_matches_probabilities() -> None:
    """40,000 seeded draws fit probabilities() (chi-square) and never hit a filtered-out token."""
    logits = np.random.default_rng(1).normal(size=12) * 2
    config = SamplingConfig(temperature=0.8, top_k=8, top_p=0.97)
    p = probabilities(logits, config)
    counts = np.bincount(draws(logits, config, 123, 40_000), minlength=logits.size)
    assert (counts[p == 0] == 0).all()
    support = p > 0
    assert chisquare(counts[support], 40_000 * p[support]).pvalue > 1e-3


@settings(max_examples=300)
@given(LOGITS, st.floats(1e-3, 100.0), st.integers(1, 50), st.integers(0, 2**32))
def test_sample_from_topk_draws_the_same_token_as_sample(logits: np.ndarray, temperature: float, k: int,
                                                         seed: int) -> None:
    """From the top-K (values, ids), in any order, the same rng state yields the token sample() yields."""
    config = SamplingConfig(temperature=temperature, top_k=k)
    values, ids = top_k(logits, k)
    shuffle = np.random.default_rng(seed).permutation(values.size)
    expected = sample(logits, config, np.random.default_rng(seed))
    assert sample_from_topk(values[shuffle], ids[shuffle], config, np.random.default_rng(seed)) == expected


def test_sample_from_topk_matches_the_top_k_distribution() -> None:
    """Many draws from the top-K entries fit probabilities() of the full row (chi-square)."""
    logits = np.random.default_rng(2).normal(size=100) * 3
    config = SamplingConfig(temperature=1.3, top_k=10)
    values, ids = top_k(logits, 10)
    rng = np.random.default_rng(5)
    counts = np.bincount([sample_from_topk(values, ids, config, rng) for _ in range(30_000)], minlength=100)
    p = probabilities(logits, config)
    assert kept(counts) == kept(p)
    assert chisquare(counts[p > 0], 30_000 * p[p > 0]).pvalue > 1e-3


def test_sample_from_topk_greedy_picks_the_largest_value() -> None:
    """Greedy over top-K entries returns the id of the largest value, the lowest id among ties."""
    token = sample_from_topk(row(1.0, 4.0, 4.0), np.array([9, 30, 12]), SamplingConfig(), np.random.default_rng())
    assert token == 12


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """What a last stage sends on "topk:K" for one row of logits, as the worker builds it."""
    scores = Scores.from_logits(logits[None, :], f"topk:{k}")
    assert scores.indices is not None
    return scores.values[0], scores.indices[0]


@pytest.mark.parametrize(("config", "rows", "expected"), [
    (SamplingConfig(), 1, "argmax@1"),
    (SamplingConfig(), 4, "argmax@4"),
    (SamplingConfig(top_k=40, top_p=0.9), 1, "argmax@1"),
    (SamplingConfig(temperature=0.8, top_k=40), 1, "topk:40"),
    (SamplingConfig(temperature=0.8, top_k=40), 3, "topk:40@3"),
    (SamplingConfig(temperature=0.8, top_k=40, top_p=0.95), 1, "logits"),
    (SamplingConfig(temperature=0.8, top_p=0.95), 2, "logits@2"),
    (SamplingConfig(temperature=0.8), 1, "logits"),
])
def test_want_for_asks_the_last_stage_for_the_least_it_must_send(config: SamplingConfig, rows: int,
                                                                  expected: str) -> None:
    """Argmax ids for greedy, top-K for top-k alone, full logits otherwise, for as many rows as asked."""
    assert want_for(config, rows) == expected


# --- stopping and configs ----------------------------------------------------------------------------

def test_should_stop_on_eos_and_max_tokens() -> None:
    """Generation stops after any eos id or at max_tokens generated tokens, not before."""
    config = SamplingConfig(max_tokens=4, eos_token_ids=(2, 7))
    assert not should_stop([], config)
    assert not should_stop([5, 2, 6], config)
    assert should_stop([5, 7], config)
    assert should_stop([5, 2], config)
    assert should_stop([5, 6, 8, 9], config)


def test_eos_ids_from_generation_config_become_a_tuple() -> None:
    """An int or a list of eos ids (as generation_config.json has them) is stored as a tuple."""
    assert SamplingConfig(eos_token_ids=2).eos_token_ids == (2,)  # type: ignore[arg-type]
    assert SamplingConfig(eos_token_ids=[2, 3]).eos_token_ids == (2, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"seed": -3}, "seed must be None or an integer >= 0"),
    ({"eos_token_ids": (-1,)}, "eos_token_ids"),
])
def test_invalid_configs_raise(kwargs: dict, message: str) -> None:
    """Each out-of-range setting raises a ValueError that names it and its allowed range."""
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


# --- incremental detokenization ----------------------------------------------------------------------

PIECES = [b"caf", b"\xc3", b"\xa9", b" ok", b"\xe6\x97", b"\xa5", b"\x80", b"\xe2", b"\x82\xac", b" ", b"a"]


def byte_decode(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def sentencepiece_like_decode(ids: list[int]) -> str:
    """Like a sentencepiece decoder: one leading space of the whole text is dropped."""
    text = byte_decode(ids)
    return text[1:] if text.startswith(" ") else text


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_character_split_over_two_tokens_waits_for_the_second() -> None:
    """The first byte of "é" emits nothing; the second emits "é"; nothing is left for flush."""
    detok = IncrementalDetokenizer(byte_decode)
    assert stream(detok, [0, 1, 2, 3]) == ["caf", "", "é", " ok", ""]


def test_flush_releases_an_incomplete_character() -> None:
    """A stream that ends mid-character gives the held bytes to flush, as U+FFFD like the full decode."""
    detok = IncrementalDetokenizer(byte_decode)
    assert stream(detok, [0, 4]) == ["caf", "", "\ufffd"]


@given(st.lists(st.integers(0, len(PIECES) - 1), max_size=30), st.booleans())
def test_pushes_and_flush_concatenate_to_the_full_decode(ids: list[int], strip: bool) -> None:
    """For any ids, incl. invalid bytes and a leading-space rule, the pieces join to decode(ids)."""
    decode = sentencepiece_like_decode if strip else byte_decode
    pieces = stream(IncrementalDetokenizer(decode), ids)
    assert "".join(pieces) == decode(ids)
    if "\ufffd" not in decode(ids):
        assert not any("\ufffd" in p for p in pieces)  # no half character was ever emitted


def test_real_openvino_detokenizer_streams_the_full_decode(stories: Path) -> None:
    """With the stories260K OpenVINO detokenizer, pushes of 40 ids (multi-byte characters split) join to the decode."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(stories)
    _, detokenizer = convert_tokenizer(hf, with_detokenizer=True)
    compiled = ov.compile_model(detokenizer, "CPU")

    def decode(ids: list[int]) -> str:
        return str(compiled(np.array([ids], dtype=np.int64))[0][0])

    ids = hf("Once upon a time, Zoë drank café au lait in 日本 and said: ok! Then they went home.")["input_ids"][:40]
    assert len(ids) == 40 and any(3 + 0x80 <= i < 3 + 0x100 for i in ids)  # <0x80>..<0xFF> byte tokens
    detok = IncrementalDetokenizer(decode)
    pushed = [detok.push(i) for i in ids]
    assert "".join(pushed) + detok.flush() == decode(ids)
    assert not any("\ufffd" in p for p in pushed)
