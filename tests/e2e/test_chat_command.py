"""`ovshard chat` as a user drives it: real processes, stdin through a pipe, stories260K with the ChatML template
of tests/runtime/client/test_chat_template.py (fp32, 2 stages); also `--prompts-file` printing each completion as it finishes.

Expected answers are the greedy tokens of the in-process pipeline for the same conversation, rendered by the
same template: stories260K ends its turn at ` Lily` (the renamed <|im_end|>) after a few tokens for most
questions, and runs on for "Who is Tom?" (the long answer below).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO

import pytest
from conftest import chatml_checkpoint, compile_fp32

from ovshard.bundle import names
from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.client.launch import WorkerProcess, serve_command
from ovshard.runtime.client.text import Text
from ovshard.runtime.commands.chat import Chat, Conversation, chat_text
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.runtime.tools.wanproxy import DelayProxy
from ovshard.runtime.wire.address import parse_address

pytestmark = pytest.mark.e2e


CLI = [sys.executable, "-m", "ovshard.cli", "-q"]
LONG = "Who is Tom?"  # its greedy answer runs past 60 tokens without ending its turn
SHORT = "Once upon a time"  # answered '"Hi,' and the end of the turn
NAME, DOG = "What is your name?", "What did the dog do?"  # a 26-token answer, then one that depends on it


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


class Reference:
    """Greedy answers of the in-process pipeline (f32 hints, as the workers' --exact) to a conversation."""

    def __init__(self, bundle: Path) -> None:
        self.text = Text(bundle, read_manifest(bundle), chat=True)
        self.pipe = LocalPipeline(bundle, config=EXACT_HINTS)

    def tokens(self, messages: list[dict[str, str]], max_tokens: int) -> list[int]:
        """The answer's tokens, its stop token included when it has one."""
        return self.pipe.generate_greedy(self.text.encode_conversation(messages), max_tokens, self.text.stops)[0]

    def answer(self, messages: list[dict[str, str]], max_tokens: int = 60) -> str:
        return self.text.answer(self.tokens(messages, max_tokens))


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat_repl")
    return compile_fp32(chatml_checkpoint(stories, root / "ckpt"), root / "b", stages=2)


@pytest.fixture(scope="module")
def reference(bundle: Path) -> Reference:
    return Reference(bundle)


@pytest.fixture(scope="module")
def stages(bundle: Path) -> Iterator[list[str]]:
    """Two `ovshard serve --exact` workers on loopback, for the tests that pass --stages."""
    workers = [WorkerProcess(serve_command(bundle, i, "127.0.0.1:0", ["--exact"]), i) for i in range(2)]
    try:
        yield [w.wait_listening(120) for w in workers]
    finally:
        for w in workers:
            w.stop()


class Reader:
    """Everything a pipe delivers, read as it comes by a thread of its own."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self.data = bytearray()
        self.thread = threading.Thread(target=self._read, args=(pipe.fileno(),), daemon=True)
        self.thread.start()

    def _read(self, fd: int) -> None:
        while chunk := os.read(fd, 4096):
            self.data += chunk

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")

    def wait_for(self, found: Callable[[str], object], timeout: float = 60) -> object:
        """The first truthy ``found(text so far)``; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not (result := found(self.text())):
            assert time.monotonic() < deadline, f"not seen within {timeout} s; got {self.text()!r}"
            time.sleep(0.01)
        return result


def children(pid: int) -> list[int]:
    """The ids of the processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # not a process, or it is gone
            continue
        if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def ignores_sigint(pid: int) -> bool:
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask.split()[1], 16) >> (signal.SIGINT - 1) & 1)


@pytest.mark.parametrize("placement", [[], ["--in-process"]], ids=["workers", "in-process"])
def test_chat_keeps_the_history_and_reset_forgets_it(bundle: Path, reference: Reference, placement: list[str]) -> None:
    """Through `chat --local`, the second answer is the greedy answer to the whole conversation rendered by the
    template (not to its question alone), /stats reports it with the tokens the first turn left in the prefix
    cache, /reset brings back the first answer, EOF exits 0, and the --local workers ignore SIGINT (a terminal's
    Ctrl-C reaches the whole process group); with --in-process (a one-stage bundle's default) the same answers
    and prefix cache with no worker process at all."""
    first = reference.answer([user(NAME)])
    conversation = [user(NAME), assistant(first), user(DOG)]
    second = reference.answer(conversation)
    assert second != reference.answer([user(DOG)])  # the history changes the answer
    chat = subprocess.Popen([*CLI, "chat", str(bundle), "--local", "--exact", "--speculative", "off", *placement],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert chat.stdin is not None and chat.stdout is not None and chat.stderr is not None
    chat.stdin.write(NAME + "\n")
    chat.stdin.flush()
    line = chat.stdout.readline()  # the workers are up: the answer streams
    workers = children(chat.pid)
    assert len(workers) == (0 if placement else 2) and all(ignores_sigint(pid) for pid in workers)
    chat.stdin.write(f"{DOG}\n/stats\n/reset\n{NAME}\n")
    chat.stdin.close()
    out, err = line + chat.stdout.read(), chat.stderr.read()
    assert chat.wait(60) == 0, err
    assert out.startswith(f"{first}\n{second}\n") and out.endswith(f"\n{first}\n"), out
    stats = dict(kv.split("=") for kv in out[len(f"{first}\n{second}\n"):-len(f"\n{first}\n")].split(", "))
    tokens = reference.tokens(conversation, 60)
    assert (int(stats["new_tokens"]), stats["finish_reason"]) == (len(tokens), "stop")
    assert int(stats["prompt_tokens"]) == len(reference.text.encode_conversation(conversation))
    assert float(stats["decode_tokens_per_s"]) > 0
    assert {"stage0_compute_ms", "stage1_compute_ms", "per_hop_network_ms"} <= set(stats)
    # the first turn's KV (its prompt and answer, all but the last sampled token) stayed in the paged stages'
    # prefix cache: the second turn computes only from the first block they do not share
    seen = reference.text.encode_conversation([user(NAME)]) + reference.tokens([user(NAME)], 60)
    now = reference.text.encode_conversation(conversation)
    common = next((i for i, (a, b) in enumerate(zip(seen, now, strict=False)) if a != b), min(len(seen), len(now)))
    assert int(stats.get("cached_tokens", 0)) == min(common, len(seen) - 1, len(now) - 1) // 32 * 32 > 0
    assert "Traceback" not in err


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(bundle: Path, reference: Reference, stages: list[str]) -> None:
    """SIGINT during a long answer (stages behind 50 ms proxies) stops it after N tokens; the partial answer
    stays in the conversation (the next answer is the greedy one after it), and SIGINT at the prompt exits 0."""
    full = reference.tokens([user(LONG)], 60)  # 60 steps of 3 delayed hops: seconds for the signal to land
    assert len(full) == 60 and not set(full) & set(reference.text.stops)  # it would run to --max-tokens
    with ExitStack() as stack:
        proxies = [stack.enter_context(DelayProxy(target=parse_address(a), latency_s=0.05)) for a in stages]
        chat = subprocess.Popen([*CLI, "chat", str(bundle), "--stages", ",".join(p.address for p in proxies),
                                 "--speculative", "off", "--max-tokens", "60"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stack.callback(chat.kill)
        assert chat.stdin is not None and chat.stdout is not None and chat.stderr is not None
        out, err = Reader(chat.stdout), Reader(chat.stderr)
        chat.stdin.write(f"{LONG}\n".encode())
        chat.stdin.flush()
        out.wait_for(bool)  # the answer has begun
        chat.send_signal(signal.SIGINT)
        stopped = err.wait_for(re.compile(r"stopped by Ctrl-C after (\d+) tokens").search)
        n = int(stopped.group(1))  # type: ignore[attr-defined]
        assert 0 < n < len(full)
        partial = reference.text.answer(full[:n])
        after = reference.answer([user(LONG), assistant(partial), user(SHORT)], 60)
        chat.stdin.write(f"{SHORT}\n".encode())
        chat.stdin.flush()
        out.wait_for(lambda text: text == f"{partial}\n{after}\n")
        chat.send_signal(signal.SIGINT)  # at the prompt: leave
        assert chat.wait(60) == 0, err.text()
    assert "Traceback" not in err.text()


def test_prompts_file_prints_each_completion_as_it_finishes(bundle: Path, reference: Reference,
                                                              stages: list[str], tmp_path: Path) -> None:
    """`generate --prompts-file --streams 2`: the short answer of the second prompt is printed before the
    first prompt's, which runs to --max-tokens; both blocks are whole, and the summary is on stderr."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{LONG}\n{SHORT}\n")
    done = subprocess.run([*CLI, "generate", str(bundle), "--stages", ",".join(stages), "--chat", "--prompts-file",
                           str(prompts), "--streams", "2", "--max-tokens", "60", "--speculative", "off", "--stats",
                           "json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    long, short = reference.answer([user(LONG)], 60), reference.answer([user(SHORT)], 60)
    assert len(reference.tokens([user(SHORT)], 60)) < 60 == len(reference.tokens([user(LONG)], 60))
    assert done.stdout == f"=== [1] {SHORT}\n{short}\n=== [0] {LONG}\n{long}\n"
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert (summary["prompts"], summary["failed"]) == (2, 0)


def test_a_bundle_without_a_template_chats_in_plain_text(bundle: Path, tmp_path: Path) -> None:
    """Without a chat template, one notice on stderr, and each turn continues the messages joined one per line:
    the second answer is the greedy continuation of "question 1 \\n answer 1 \\n question 2"."""
    plain = tmp_path / "plain"
    shutil.copytree(bundle, plain)
    manifest = json.loads((plain / names.MANIFEST_FILE).read_text())
    (plain / names.MANIFEST_FILE).write_text(json.dumps({**manifest, "chat": None}))
    err, out = io.StringIO(), io.StringIO()
    text = chat_text(plain, read_manifest(plain), err)
    assert err.getvalue().count("\n") == 1 and "has no chat template" in err.getvalue()
    pipe = LocalPipeline(plain, config=EXACT_HINTS)
    config = SamplingConfig(max_tokens=12, eos_token_ids=text.stops)
    chat = Chat(pipe, text, config, None, Conversation(), io.StringIO(f"{SHORT}\nThe dog\n"), out, err)
    assert chat.run() == 0

    def continuation(prompt: str) -> str:  # what follows the prompt's last 8 ids (a first word's leading space)
        ids = text.encode(prompt, None)
        tokens = pipe.generate_greedy(ids, 12, text.stops)[0]
        return text.decode(ids[-8:] + tokens)[len(text.decode(ids[-8:])):]

    first = continuation(SHORT)
    second = continuation("\n".join((SHORT, first, "The dog")))
    assert out.getvalue() == f"{first}\n{second}\n"
