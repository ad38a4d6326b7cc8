"""The incremental detokenizer's table of plain pieces: pushes through it give what the two decodes give."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ovshard.runtime.client.text import IncrementalDetokenizer, plain_pieces

# byte pieces: ASCII words, the bytes of multi-byte characters split over tokens, a lone space, punctuation,
# a word ending in a space, a newline, and a special token that decodes to nothing
PIECES = [b"caf", b"\xc3", b"\xa9", b" ok", b"\xe6\x97", b"\xa5", b"\x80", b"\xe2", b"\x82\xac", b" ", b"a",
          b".", b" .", b"so ", b"\n", b""]


def byte_decode(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def sentencepiece_like_decode(ids: list[int]) -> str:
    """One leading space of the whole text is dropped."""
    text = byte_decode(ids)
    return text[1:] if text.startswith(" ") else text


def cleanup_decode(ids: list[int]) -> str:
    """As Hugging Face's clean_up_tokenization_spaces: a space before punctuation goes, across tokens too."""
    return byte_decode(ids).replace(" .", ".")


def rows_of(decode: Callable[[list[int]], str]) -> Callable[[np.ndarray], list[str]]:
    return lambda rows: [decode([int(t) for t in row]) for row in rows]


def pushed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


@given(st.lists(st.integers(0, len(PIECES) - 1), max_size=30),
       st.sampled_from([byte_decode, sentencepiece_like_decode, cleanup_decode]))
def test_pieces_give_what_the_decodes_give(ids: list[int], decode: Callable[[list[int]], str]) -> None:
    """For any ids and any of three decoders (byte-level, a leading-space rule, a cleanup across tokens), every
    push through the table equals the push that decodes."""
    pieces = plain_pieces(rows_of(decode), len(PIECES))
    assert pushed(IncrementalDetokenizer(decode, pieces), ids) == pushed(IncrementalDetokenizer(decode), ids)


@given(st.lists(st.integers(0, len(PIECES) - 1), max_size=30), st.integers(0, 30),
       st.sampled_from([byte_decode, sentencepiece_like_decode, cleanup_decode]))
def test_pieces_taken_up_mid_stream_give_what_the_decodes_give(ids: list[int], at: int,
                                                               decode: Callable[[list[int]], str]) -> None:
    """A stream that began without the table and takes it up at any token (built behind, as `ovshard chat`
    builds it) gives the pushes the decodes give, and looks up the plain tokens after that point."""
    pieces = plain_pieces(rows_of(decode), len(PIECES))
    calls = []
    counted = IncrementalDetokenizer(lambda ids: calls.append(1) or decode(ids))
    got = []
    for n, token in enumerate(ids):
        if n == at:
            counted.use_pieces(pieces)
        got.append(counted.push(token))
    got.append(counted.flush())
    assert got == pushed(IncrementalDetokenizer(decode), ids)
    if at == 0 and all(pieces[t] is not None for t in ids):
        assert len(calls) <= 1  # every token plain: the first one decoded, every later one looked up


def test_context_dependent_tokens_are_not_plain() -> None:
    """Bytes of unfinished characters, the empty special token and, under a cleanup, the punctuation it rewrites
    have no piece; plain words and spaces have theirs, with the space a sentencepiece rule drops at the start."""
    pieces = plain_pieces(rows_of(byte_decode), len(PIECES))
    assert [pieces[i] for i in (0, 3, 9, 11, 14)] == ["caf", " ok", " ", ".", "\n"]
    assert all(pieces[i] is None for i in (1, 2, 4, 5, 6, 7, 8, 15))
    assert plain_pieces(rows_of(sentencepiece_like_decode), len(PIECES))[3] == " ok"
    cleaned = plain_pieces(rows_of(cleanup_decode), len(PIECES))
    assert cleaned[11] is None and cleaned[12] == "." and cleaned[0] == "caf"  # " ." is "." after anything


def test_real_openvino_detokenizer_table_matches_the_decodes(stories: Path) -> None:
    """With the stories260K OpenVINO detokenizer (sentencepiece, byte fallback), a story's tokens and 200 random
    streams give the same pushes through the table as through the decodes, and most tokens are plain."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(stories)
    _, detokenizer = convert_tokenizer(hf, with_detokenizer=True)
    compiled = ov.compile_model(detokenizer, "CPU")

    def decode_rows(rows: np.ndarray) -> list[str]:
        return [str(s) for s in compiled(rows.astype(np.int64))[0]]

    def decode(ids: list[int]) -> str:
        return decode_rows(np.array([ids]))[0]

    vocab = len(hf)
    pieces = plain_pieces(decode_rows, vocab)
    assert sum(p is not None for p in pieces) > vocab // 2
    rng = random.Random(0)
    story = hf("Once upon a time, Zoë drank café au lait in 日本 and said: ok! Then they went home.")["input_ids"]
    for ids in [story, *([rng.randrange(vocab) for _ in range(40)] for _ in range(200))]:
        assert pushed(IncrementalDetokenizer(decode, pieces), ids) == pushed(IncrementalDetokenizer(decode), ids)
