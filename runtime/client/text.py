"""Text in and out of a pipeline: the bundle's tokenizer (or plain ids), its chat template, and one incremental
decoder of a completion's tokens into text that the CLI, `ovshard chat` and the API share."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.bundle.manifest import Manifest
from ovshard.errors import OvshardError
from ovshard.runtime.client.chat_template import ChatTemplate, compile_plain_tokenizer, stop_ids

REPLACEMENT = "\ufffd"  # what a decode with errors="replace" yields for an incomplete UTF-8 sequence
PRIME_TOKENS = 8  # prompt ids a continuation's decoder starts from: a first word's leading space depends on them


class Text:
    """Tokenizer and detokenizer from the bundle, or plain ids when it has none; with ``chat``, the chat
    template too: prompts become one user message, and answers stop at the end of the turn."""

    def __init__(self, bundle: Path, m: Manifest, chat: bool = False) -> None:
        self.tok = self.detok = self.plain_tok = None
        self.chat: ChatTemplate | None = None
        self.vocab_size = m.architecture.vocab_size  # token ids given as numbers must be below it
        self.stops = m.generation.eos_token_ids  # what generation stops at
        self._lock = threading.Lock()  # a compiled tokenizer model runs one call at a time
        self._pieces: list[str | None] | None = None  # plain_pieces() of the detokenizer, built on first use
        self._building = threading.Lock()  # one build of the pieces at a time (a background one and a call)
        if m.tokenizer:
            import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)

            core = ov.Core()
            self.tok = core.compile_model(str(bundle / m.tokenizer.tokenizer), "CPU")
            self.detok = core.compile_model(str(bundle / m.tokenizer.detokenizer), "CPU")
            if chat:  # the rendered template holds every special token: the tokenizer adds none (no double BOS)
                self.chat = ChatTemplate.from_manifest(bundle, m)
                self.plain_tok = compile_plain_tokenizer(core, bundle / m.tokenizer.tokenizer)
                self.stops = stop_ids(m)
        elif chat:
            raise OvshardError(f"--chat needs the bundle's tokenizer, and {bundle} has none (its checkpoint had no "
                               "tokenizer the compile could convert): leave out --chat and pass --prompt-ids")

    def encode(self, prompt: str, prompt_ids: str | None, where: str = "--prompt-ids") -> list[int]:
        """``prompt_ids`` parsed and checked against the vocabulary (errors name ``where``), else ``prompt``
        tokenized (with --chat: rendered by the chat template as one user message first)."""
        if prompt_ids is not None:
            if self.chat is not None:
                raise OvshardError(f"{where} with --chat: the chat template takes text; pass --prompt TEXT, or "
                                   "leave out --chat to feed token ids as they are")
            return parse_token_ids(prompt_ids, self.vocab_size, where)
        if self.tok is None:
            raise OvshardError("this bundle has no tokenizer: pass --prompt-ids 1,5,17")
        if self.chat is not None and self.plain_tok is not None:
            return self.encode_conversation([{"role": "user", "content": prompt}])
        return self.tokenize(prompt)

    def tokenize(self, prompt: str) -> list[int]:
        """``prompt``'s ids as the bundle's tokenizer gives them (special tokens added as it adds them)."""
        if self.tok is None:
            raise OvshardError("this bundle has no tokenizer: pass --prompt-ids 1,5,17")
        with self._lock:
            return [int(t) for t in self.tok([prompt])["input_ids"][0]]

    def encode_conversation(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation's prompt ids: rendered by the chat template with the generation prompt and tokenized
        without added special tokens (the template wrote them); without a template, the contents one per
        line, tokenized as any prompt (`ovshard chat` and the API's chat endpoint)."""
        if self.chat is not None and self.plain_tok is not None:
            rendered = self.chat.render(messages, add_generation_prompt=True)
            with self._lock:
                return [int(t) for t in self.plain_tok([rendered])["input_ids"][0]]
        return self.encode("\n".join(m["content"] for m in messages), None)

    def decode(self, ids: list[int]) -> str:
        if self.detok is None:
            return " ".join(map(str, ids)) + " "
        with self._lock:
            return str(self.detok(np.array([ids], dtype=np.int64))["string_output"][0])

    def decode_rows(self, rows: np.ndarray) -> list[str]:
        """The text of each row of ``rows`` [N, T] (one detokenizer call for all of them)."""
        assert self.detok is not None, "decode_rows needs the bundle's detokenizer"
        with self._lock:
            return [str(s) for s in self.detok(rows.astype(np.int64))["string_output"]]

    def pieces(self) -> list[str | None] | None:
        """Each token's text after any complete text (:func:`plain_pieces`), None without a detokenizer; the
        first call decodes the vocabulary a few times (a tenth of a second for 50k tokens)."""
        if self.detok is None:
            return None
        with self._building:
            if self._pieces is None:
                self._pieces = plain_pieces(self.decode_rows, self.vocab_size)
        return self._pieces

    @property
    def built_pieces(self) -> list[str | None] | None:
        """:meth:`pieces` if a call built them already (a server builds them once at start), else None."""
        return self._pieces

    def answer(self, ids: list[int]) -> str:
        """A chat answer's text: the stop ids left out, and no special token in it."""
        return self.shown(self.decode([t for t in ids if t not in self.stops]))

    def shown(self, text: str) -> str:
        """``text`` as printed: with --chat, without special tokens (the detokenizer skips those it knows)."""
        return self.chat.clean(text) if self.chat is not None else text


TOKEN_ID = re.compile(r"-?[0-9]+")  # a sign is let through so that a negative id gets the range message


def parse_token_ids(text: str, vocab_size: int, where: str = "--prompt-ids") -> list[int]:
    """The comma-separated token ids in ``text``, each in ``[0, vocab_size)``; OvshardError naming ``where``."""
    parts = [part.strip() for part in text.split(",")]
    shown = text if len(text) <= 60 else text[:57] + "..."
    if not all(TOKEN_ID.fullmatch(part) for part in parts):
        raise OvshardError(f"{where} {shown!r}: expected comma-separated token ids, e.g. 1,403,407")
    ids = [int(part) for part in parts]
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise OvshardError(f"{where} {shown!r}: token id {outside[0]} is outside this bundle's vocabulary; "
                           f"expected ids in [0, {vocab_size}), i.e. 0 to {vocab_size - 1}")
    return ids


def encode_prompts(text: Text, prompts: list[str], path: Path) -> list[list[int]]:
    """The token ids of each prompt of ``--prompts-file path``: tokenized, or without a tokenizer read as ids
    (errors name the file and the prompt, counting non-empty lines from 1)."""
    if text.tok is not None:
        return [text.encode(prompt, None) for prompt in prompts]
    return [text.encode("", line, f"--prompts-file {path}, prompt {n}") for n, line in enumerate(prompts, 1)]


def plain_pieces(decode_rows: Callable[[np.ndarray], list[str]], vocab: int) -> list[str | None]:
    """For each token id, the text it adds after any complete text, or None where that depends on what precedes
    (a special token that decodes to nothing, a byte of an unfinished character, a rule that rewrites text
    across tokens, such as a cleanup of the space before punctuation).

    Each token is decoded after a few reference tokens, one whose text ends in a letter, one in a space, one in
    a newline and one in punctuation (found by decoding every token alone): a token is plain when each
    reference's text is kept as it was and the same non-empty text, without U+FFFD, follows it every time.
    Four detokenizer calls of ``vocab`` rows each, plus one to find the references."""
    ids = np.arange(vocab, dtype=np.int64)
    alone = decode_rows(ids[:, None])
    refs = []
    for wanted in (str.isalpha, lambda c: c == " ", lambda c: c == "\n", lambda c: c in ".,!?"):
        ref = next((t for t, text in enumerate(alone) if text and wanted(text[-1])), None)
        if ref is not None:
            refs.append(ref)
    if not refs:
        return [None] * vocab
    pieces: list[str | None] = [None] * vocab
    after = [decode_rows(np.stack([np.full(vocab, ref, np.int64), ids], axis=1)) for ref in refs]
    before = [alone[ref] for ref in refs]
    for t in range(vocab):
        texts = [text[t] for text in after]
        if not all(text.startswith(head) for text, head in zip(texts, before, strict=True)):
            continue
        tails = {text[len(head):] for text, head in zip(texts, before, strict=True)}
        piece = tails.pop()
        if not tails and piece and REPLACEMENT not in piece:
            pieces[t] = piece
    return pieces


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, never emitting half a character.

    Each push decodes a short window of recent ids twice, without and with the new ones, and emits the
    difference (the scheme of Hugging Face text-generation-inference). Decoding a window, rather than
    one token, keeps what depends on context right: sentencepiece's leading-space rule, and bytes of
    one character spread over several tokens. While the decode ends in U+FFFD the character is
    incomplete and nothing is emitted; flush() at the end of the stream releases whatever is held back.
    The concatenation of every push and the flush equals decode(all ids).

    With ``pieces`` (:func:`plain_pieces`), a plain token pushed after text that was all emitted adds its piece
    without a decode: what the two decodes would have given, at a list lookup's cost.
    """

    def __init__(self, decode: Callable[[list[int]], str], pieces: Sequence[str | None] | None = None) -> None:
        self._decode = decode
        self._pieces = pieces
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are fully emitted and no longer decoded
        self._read = 0  # ids before this are emitted; [prefix, read) gives the text already sent

    @property
    def pieces(self) -> Sequence[str | None] | None:
        return self._pieces

    def use_pieces(self, pieces: Sequence[str | None]) -> None:
        """Look plain tokens up from now on (pieces built after the stream began): each push decides alone."""
        self._pieces = pieces

    def _text(self, start: int, end: int) -> str:
        return self._decode(self._ids[start:end]) if end > start else ""

    def push(self, token: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        token = int(token)
        if self._pieces is not None and self._prefix < self._read == len(self._ids) and 0 <= token < len(self._pieces):
            piece = self._pieces[token]
            if piece is not None:  # after complete text, a plain token adds its piece (the class docstring)
                self._ids.append(token)
                self._prefix, self._read = self._read, len(self._ids)
                return piece
        self._ids.append(token)
        sent = self._text(self._prefix, self._read)
        text = self._text(self._prefix, len(self._ids))
        if len(text) <= len(sent) or text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(sent):]

    def flush(self) -> str:
        """End of stream: return everything not yet emitted, incomplete characters included (as U+FFFD)."""
        if self._read == len(self._ids):
            return ""  # every id's text was emitted: the two decodes would be the same text
        sent = self._text(self._prefix, self._read)
        text = self._text(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return text[len(sent):]


class TextStream:
    """One completion's text as its tokens arrive: what each token adds to the text shown.

    A continuation of plain text starts its decoder from the prompt's last PRIME_TOKENS ids (sentencepiece's
    leading-space rule and multi-token characters depend on what precedes); an answer in a chat turn starts
    from nothing and is shown without special tokens. Stop ids (end of turn, eos) add no text. Text that may
    be the start of a stop string is held back until it cannot be, and the first stop string met ends the
    text (``stopped``). The pushes and ``finish()`` together give the completion's text. Once the Text's
    :meth:`~Text.pieces` are built, plain tokens are looked up, not decoded (the API builds them at start, `run`
    while its stages load, `chat` behind, and a stream takes them up from the token they appear at).
    """

    def __init__(self, text: Text, prompt: Sequence[int], *, turn: bool | None = None,
                 stop_ids: Sequence[int] | None = None, stop_strings: Sequence[str] = ()) -> None:
        self.text = text
        self.turn = text.chat is not None if turn is None else turn
        self.stop_ids = frozenset(text.stops if stop_ids is None else stop_ids)
        self.stop_strings = tuple(stop_strings)
        self.detok = IncrementalDetokenizer(text.decode, text.built_pieces)
        if not self.turn:
            for token in prompt[-PRIME_TOKENS:]:
                self.detok.push(token)
        self.held = ""  # decoded, not shown yet: it may begin a stop string
        self.stopped = False

    def push(self, token: int) -> str:
        """The text ``token`` adds that can be shown now ("" while it may begin a stop string)."""
        if self.stopped or token in self.stop_ids:
            return ""
        if self.detok.pieces is None and self.text.built_pieces is not None:  # built behind since the start
            self.detok.use_pieces(self.text.built_pieces)
        self.held += self._clean(self.detok.push(token))
        return self._release(final=False)

    def finish(self) -> str:
        """The end of the completion: whatever is still held back."""
        if not self.stopped:
            self.held += self._clean(self.detok.flush())
        return self._release(final=True)

    def _clean(self, piece: str) -> str:
        return self.text.shown(piece) if self.turn else piece

    def _release(self, final: bool) -> str:
        for stop in self.stop_strings:
            at = self.held.find(stop)
            if at >= 0:
                self.held, self.stopped, final = self.held[:at], True, True
        keep = 0 if final else max((len(s) - 1 for s in self.stop_strings), default=0)
        cut = max(len(self.held) - keep, 0)
        shown, self.held = self.held[:cut], self.held[cut:]
        return shown
