"""``ovshard chat``: an interactive terminal chat over a pipeline, with history, streaming and commands.

Each line typed is a user message. The whole conversation so far ([system], user, assistant, ..., user) is
rendered through the bundle's chat template with the generation prompt, tokenized as ``ovshard api`` does
(no special tokens added: the template wrote them) and generated on a fresh stream; the answer streams to
stdout as it is sampled and joins the conversation as it was shown. A bundle without a chat template chats
in plain text: the contents of the messages, one per line, are continued as they are (``ovshard api``'s
fallback too), and a one-line notice on stderr says so.

    /reset   forget the conversation (the --system prompt stays)
    /stats   the last answer's figures: tokens/s, speculative acceptance, per-stage compute, per-hop network
    /quit    leave; so do end-of-file (Ctrl-D) and Ctrl-C at the prompt, with exit 0

Ctrl-C during an answer stops that answer and returns to the prompt. A SIGINT handler installed for the
turn only sets a flag, which the token loop reads after each token, so no KeyboardInterrupt fires inside
the head's socket code; the token generator is then closed, which closes the stream on every stage. The
partial answer stays in the conversation, as it was shown. With ``--local`` a one-stage bundle runs in this
process (as `ovshard run` runs it: no socket between a token and its stage; ``--workers`` for worker processes),
and stage workers ignore SIGINT (a terminal sends Ctrl-C to the whole process group); they stop when the chat ends.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from ovshard.bundle.manifest import Manifest, read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.client.text import Text, TextStream
from ovshard.runtime.commands.options import (
    add_decoding,
    add_pipeline,
    add_placement,
    add_security,
    sampling_config,
    speculation_config,
    stages_head,
)
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.sampler import SamplingConfig

PROMPT = "> "  # shown before each line when stdin is a terminal
HELP = "/reset forgets the conversation, /stats shows the last answer's figures, /quit leaves"


class Generates(Protocol):
    """What the chat drives: a Head (or, in tests, anything with its ``generate``)."""

    def generate(self, prompt: list[int], config: SamplingConfig, stats: Stats | None = None,
                 speculation: Speculation | None = None) -> Generator[int, None, None]: ...


@dataclass
class Conversation:
    """The messages so far, after an optional system prompt that /reset keeps."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, user: str) -> list[dict[str, str]]:
        """The conversation with ``user`` as its next message."""
        first = [{"role": "system", "content": self.system}] if self.system else []
        return [*first, *self.turns, {"role": "user", "content": user}]

    def add(self, user: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]

    def reset(self) -> None:
        self.turns.clear()


@contextmanager
def ctrl_c_as_flag() -> Iterator[threading.Event]:
    """SIGINT sets the yielded flag instead of raising KeyboardInterrupt; the previous handler after."""
    flag = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class Turn:
    """One answer: its text as shown, its stats, and whether Ctrl-C stopped it."""

    text: str
    stats: Stats
    interrupted: bool

    def report(self) -> dict:
        """Stats.to_dict(), with finish_reason "interrupted" for an answer Ctrl-C stopped."""
        report = self.stats.to_dict()
        if self.interrupted:
            report["finish_reason"] = "interrupted"
        return report


class Chat:
    """The read-answer loop over one head: commands, turns, and the last answer's stats."""

    def __init__(self, head: Generates, text: Text, config: SamplingConfig, speculation: Speculation | None,
                 conversation: Conversation, stdin: TextIO, out: TextIO, err: TextIO) -> None:
        self.head, self.text, self.config, self.speculation = head, text, config, speculation
        self.conversation, self.stdin, self.out, self.err = conversation, stdin, out, err
        self.tty = stdin.isatty()
        self.last: Turn | None = None
        self.failed = 0  # answers that failed with an error (they make the exit code 1)

    def run(self) -> int:
        """Read and answer lines until /quit, end-of-file or Ctrl-C at the prompt; 1 if an answer failed."""
        if self.tty:
            _line_editing()
            print(f"ovshard chat: {HELP}; Ctrl-C stops an answer, Ctrl-D leaves", file=self.err)
        try:
            while (line := self.read()) is not None and self.handle(line.strip()):
                pass
        except KeyboardInterrupt:  # Ctrl-C between turns, outside an answer: leave as at the prompt
            self.out.write("\n")
        return 1 if self.failed else 0

    def read(self) -> str | None:
        """The next line, or None at end-of-file or on Ctrl-C (both end the chat)."""
        try:
            if self.tty:
                return input(PROMPT)
            return self.stdin.readline() or None
        except EOFError:
            return None
        except KeyboardInterrupt:
            self.out.write("\n")
            return None

    def handle(self, line: str) -> bool:
        """Run one command or answer one message; False to leave."""
        if line == "/quit":
            return False
        if line == "/reset":
            self.conversation.reset()
            print("(conversation forgotten)", file=self.err)
        elif line == "/stats":
            self.stats()
        elif line.startswith("/"):
            print(f"unknown command {line.split()[0]}: expected /reset, /stats or /quit", file=self.err)
        elif line:
            self.turn(line)
        return True

    def stats(self) -> None:
        if self.last is None:
            print("no answer yet: /stats shows the figures of the last answer", file=self.err)
            return
        print(", ".join(f"{k}={v}" for k, v in self.last.report().items()), file=self.out, flush=True)

    def turn(self, user: str) -> None:
        """Answer ``user`` after the conversation so far; keep both, unless the answer failed."""
        with ctrl_c_as_flag() as stop:
            try:
                ids = self.text.encode_conversation(self.conversation.messages(user))
                answer = self.answer(ids, stop)
            except OvshardError as e:
                self.failed += 1
                print(f"error: {e} (this message is not kept; /reset starts a new conversation)", file=self.err)
                return
        self.last = answer
        self.conversation.add(user, answer.text)
        if answer.interrupted:
            print(f"(stopped by Ctrl-C after {answer.stats.new_tokens} tokens; the partial answer stays in the "
                  "conversation)", file=self.err)

    def answer(self, ids: list[int], stop: threading.Event) -> Turn:
        """Stream the answer to ``ids`` to stdout until a stop id, --max-tokens, or ``stop`` is set."""
        stats = Stats()
        stream = TextStream(self.text, ids)
        shown: list[str] = []
        tokens = self.head.generate(ids, self.config, stats, self.speculation)
        try:
            for token in tokens:
                self.show(shown, stream.push(token))
                if stop.is_set():
                    break
        finally:
            tokens.close()  # closes the stream on every stage
            self.show(shown, stream.finish())
            self.out.write("\n")
            self.out.flush()
        return Turn("".join(shown), stats, interrupted=not stats.finish_reason)  # "" if it did not finish

    def show(self, shown: list[str], piece: str) -> None:
        if piece:
            shown.append(piece)
            self.out.write(piece)
            self.out.flush()


def chat_text(bundle: Path, m: Manifest, err: TextIO) -> Text:
    """The bundle's tokenizer with its chat template; without a template, plain text and a notice on ``err``."""
    if m.tokenizer is None:
        raise OvshardError(f"ovshard chat needs the bundle's tokenizer, and {bundle} has none (its checkpoint had "
                           "no tokenizer the compile could convert); use `ovshard generate --prompt-ids` instead")
    if m.chat is None:
        print(f"ovshard chat: {bundle} has no chat template; each message is plain text and the conversation, "
              "one message per line, is continued as it is", file=err)
    return Text(bundle, m, chat=m.chat is not None)


def main_chat(args: argparse.Namespace) -> int:
    """``ovshard chat BUNDLE --stages ... | --local``: read stdin, answer on stdout, notices on stderr."""
    m = read_manifest(args.bundle)
    text = chat_text(args.bundle, m, sys.stderr)
    config = sampling_config(args, text.stops)
    speculation = speculation_config(args, m)
    conversation = Conversation(args.system)
    # the detokenizer's table of plain tokens is built while the stages load and the user types (a stream takes it
    # up once it is there); leaving waits for it, so that no thread is inside OpenVINO as the process ends
    with ThreadPoolExecutor(1) as pool:
        pool.submit(text.pieces)
        # in this process: paged, one sequence whose blocks the next turn's prompt reuses; workers ignore SIGINT
        with stages_head(args, ignore_sigint=True) as head:
            return Chat(head, text, config, speculation, conversation, sys.stdin, sys.stdout, sys.stderr).run()


def _line_editing() -> None:
    """Line editing and history for input() at a terminal, where the readline module exists."""
    try:
        import readline  # noqa: F401  (importing it is what turns it on)
    except ImportError:
        pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal through stage workers (or --local), with history",
                       description="An interactive chat: each line read is a user message; the conversation so "
                       "far is rendered by the bundle's chat template (without one: plain text, one message per "
                       "line) and the answer streams to stdout. /reset forgets the conversation, /stats prints "
                       "the last answer's figures (tokens/s, speculative acceptance, per-stage compute ms, "
                       "per-hop network ms), /quit or end-of-file (Ctrl-D) leaves. Ctrl-C stops an answer (the "
                       "part shown stays in the conversation); at the prompt it leaves.")
    p.add_argument("bundle", type=Path)
    add_pipeline(p)
    p.add_argument("--system", help="a system prompt: the first message of every conversation (kept by /reset)")
    p.add_argument("--exact", action="store_true", help="with --local: f32 inference and KV cache")
    p.add_argument("--threads", type=int, help="with --local: CPU threads per stage")
    add_placement(p)
    add_decoding(p, max_tokens=256)
    add_security(p)
    p.set_defaults(func=main_chat)
