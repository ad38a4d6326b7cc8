"""Chat templates end to end: into the bundle at compile, rendered by jinja2 at run time, `--chat` on the CLI.

The checkpoint is the real stories260K with a ChatML template. Its 512-token vocabulary has no chat tokens,
so two tokens are renamed and marked special: the byte token ``<0x00>`` becomes ``<|im_start|>``, and
`` Lily`` (which the model writes in nearly every story) becomes ``<|im_end|>``, so the model really ends
its turn. The template writes ``{{ bos_token }}`` as Gemma's and Llama 2's do, while the tokenizer adds BOS
itself: the rendered prompt must carry exactly one. The real Gemma 3 270M tokenizer with Gemma's own
template checks the same on a production vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from conftest import CHATML, chatml_checkpoint, compile_fp32
from real_gemma import gemma_hf_reference  # noqa: F401  (a fixture)

from ovshard.bundle import names
from ovshard.bundle.manifest import Manifest, read_manifest, verify_files
from ovshard.errors import BundleError, OvshardError
from ovshard.frontend.chat import end_of_turn_ids
from ovshard.frontend.tokenizer import convert_tokenizer
from ovshard.runtime.client.chat_template import ChatTemplate, stop_ids
from ovshard.runtime.client.text import Text

pytestmark = pytest.mark.slow


OVSHARD = [sys.executable, "-m", "ovshard.cli"]
NOWHERE = "127.0.0.1:1,127.0.0.1:2"  # generate fails on its arguments before it connects to any stage
IM_END = 317  # the id of ▁Lily in stories260K
CONVERSATIONS = [
    [{"role": "user", "content": "Once upon a time"}],
    [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "  A cat and a dog  "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! There was a frog."},
     {"role": "user", "content": "What did the frog do?"}],
    [{"role": "user", "content": "Hi", "name": None}, {"role": "assistant", "content": "ünïcode ☃"}],
]
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""  # Gemma 3's template, its image branches left out (the GGUF in the dev extra carries none)


@pytest.fixture(scope="module")
def checkpoint(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chatml_checkpoint(stories, tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture(scope="module")
def bundle(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(checkpoint, tmp_path_factory.mktemp("chat") / "b", stages=2)


@pytest.fixture(scope="module")
def hf(checkpoint: Path):  # noqa: ANN201  (a transformers tokenizer)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def ovshard(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*OVSHARD, *map(str, argv)], capture_output=True, text=True, timeout=300)


def test_manifest_records_template_tokens_and_end_of_turn(bundle: Path) -> None:
    """The manifest names chat_template.jinja (the checkpoint's text, checksummed), the named special tokens
    and <|im_end|> as the end of a turn; generation then stops at eos or <|im_end|>."""
    m = read_manifest(bundle)
    assert m.chat is not None and (bundle / m.chat.template).read_text() == CHATML
    assert m.chat.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert m.chat.end_of_turn_ids == (IM_END,) and m.chat.named == {}
    assert stop_ids(m) == (2, 1, IM_END)


def test_an_edited_template_fails_its_checksum(bundle: Path, tmp_path: Path) -> None:
    """verify_files checks chat_template.jinja like every other file of the bundle."""
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    verify_files(copy, read_manifest(copy))
    with open(copy / names.CHAT_TEMPLATE, "a") as f:
        f.write(" ")
    with pytest.raises(BundleError, match="chat_template.jinja has sha256"):
        verify_files(copy, read_manifest(copy))


def test_merge_carries_the_template(bundle: Path, tmp_path: Path) -> None:
    """`ovshard bundle merge` copies the chat template with the tokenizer: the merged bundle verifies and chats."""
    from ovshard.merge import merge_bundles

    merged = merge_bundles([bundle], tmp_path / "merged")  # a complete bundle is a valid part
    assert merged.chat == read_manifest(bundle).chat
    verify_files(tmp_path / "merged", read_manifest(tmp_path / "merged"))


def test_manifest_with_chat_round_trips_and_stays_strict(bundle: Path) -> None:
    """The chat entry decodes and encodes back key for key; an unknown key in it is refused by place, and a
    manifest without the entry (written before chat templates) reads as having none."""
    d = json.loads((bundle / names.MANIFEST_FILE).read_text())
    assert json.loads(Manifest.from_dict(d).to_json()) == d
    with pytest.raises(BundleError, match=r"manifest.json.chat: unknown key 'stop'"):
        Manifest.from_dict({**d, "chat": {**d["chat"], "stop": [1]}})
    assert Manifest.from_dict({k: v for k, v in d.items() if k != "chat"}).chat is None


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "turns", "none-and-unicode"])
@pytest.mark.parametrize("prompt", [True, False], ids=["generation-prompt", "no-prompt"])
def test_rendering_equals_transformers(bundle: Path, hf, conversation: list[dict], prompt: bool) -> None:  # noqa: ANN001
    """Our jinja2 rendering of the bundle's template is transformers' apply_chat_template text, character for character."""
    ours = ChatTemplate.from_manifest(bundle, read_manifest(bundle)).render(conversation, add_generation_prompt=prompt)
    assert ours == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)


def test_prompt_ids_equal_transformers_with_one_bos(bundle: Path, hf) -> None:  # noqa: ANN001
    """--chat feeds transformers' apply_chat_template(tokenize=True) ids: the template's <s>, not a second one."""
    text = Text(bundle, read_manifest(bundle), chat=True)
    for prompt in ("Once upon a time", "Lily and Ben went to the park.", "ünïcode ☃ text"):
        ids = text.encode(prompt, None)
        expected = hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        assert ids == expected["input_ids"], prompt
        assert ids[:2] == [1, 3] and ids.count(1) == 1  # <s><|im_start|>
    assert Text(bundle, read_manifest(bundle)).encode("Hi", None)[:1] == [1]  # without --chat the tokenizer adds <s>


def test_chat_answer_stops_at_end_of_turn_without_special_tokens(bundle: Path) -> None:
    """`run --chat` prints only the answer, the greedy tokens up to the model's first <|im_end|>, and stops there."""
    from ovshard.runtime.client.inprocess import LocalPipeline
    from ovshard.runtime.engine.stage import EXACT_HINTS

    m = read_manifest(bundle)
    text = Text(bundle, m, chat=True)
    greedy = LocalPipeline(bundle, config=EXACT_HINTS).generate_greedy(text.encode("Once upon a time", None), 60)[0]
    end = next(i for i, t in enumerate(greedy) if t in stop_ids(m))
    assert greedy[end] == IM_END and 0 < end  # the model ends its turn before any eos
    done = ovshard("run", bundle, "--local", "--exact", "--chat", "--prompt", "Once upon a time", "--max-tokens", 60,
                   "--stats", "json")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stderr.strip().splitlines()[-1])
    assert (stats["new_tokens"], stats["finish_reason"]) == (end + 1, "stop")
    assert done.stdout == text.decode(greedy[:end]) + "\n"  # the answer alone: no prompt, no <|im_end|>
    assert done.stdout.strip() and not any(s in done.stdout for s in ("<|im_", "<s>", "</s>"))


def test_chat_prompts_file_answers_each_line(bundle: Path, tmp_path: Path) -> None:
    """With --prompts-file, --chat makes each line a user message and prints each answer alone, ended at its turn."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nTell me about a dog\n")
    done = ovshard("run", bundle, "--local", "--exact", "--chat", "--prompts-file", prompts, "--max-tokens", 60)
    assert done.returncode == 0, done.stderr
    blocks = done.stdout.split("=== ")[1:]
    assert [b.splitlines()[0] for b in blocks] == ["[0] Once upon a time", "[1] Tell me about a dog"]
    for block in blocks:
        answer = block.split("\n", 1)[1]
        assert answer.strip() and not any(s in answer for s in ("<|im_", "<s>", "</s>", "user\n"))


def test_chat_without_a_template_is_refused(bundle: Path, tmp_path: Path) -> None:
    """--chat on a bundle whose checkpoint had no chat template exits 2 saying so, as does --chat with --prompt-ids."""
    plain = tmp_path / "plain"
    shutil.copytree(bundle, plain)
    manifest = json.loads((plain / names.MANIFEST_FILE).read_text())
    (plain / names.MANIFEST_FILE).write_text(json.dumps({**manifest, "chat": None}))
    done = ovshard("generate", plain, "--stages", NOWHERE, "--chat", "--prompt", "Hi")
    assert done.returncode == 2 and "has no chat template" in done.stderr and "Traceback" not in done.stderr
    done = ovshard("generate", bundle, "--stages", NOWHERE, "--chat", "--prompt-ids", "1,5")
    assert done.returncode == 2 and "--prompt-ids with --chat" in done.stderr


def test_openvino_genai_finds_the_template(bundle: Path, hf) -> None:  # noqa: ANN001
    """openvino_genai.Tokenizer reads the bundle's template from the tokenizer IR and renders transformers' text."""
    script = ("import json, sys, openvino_genai\n"
              "t = openvino_genai.Tokenizer(sys.argv[1])\n"
              "print(json.dumps([t.chat_template, t.apply_chat_template(json.loads(sys.argv[2]), "
              "add_generation_prompt=True)]))\n")
    conversation = CONVERSATIONS[2]
    done = subprocess.run([sys.executable, "-c", script, str(bundle), json.dumps(conversation)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CI": "true"})
    assert done.returncode == 0, done.stderr
    template, rendered = json.loads(done.stdout.strip().splitlines()[-1])
    assert template == CHATML
    assert rendered == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def test_named_templates_are_kept_and_the_default_is_in_rt_info(stories: Path, tmp_path: Path) -> None:
    """A list of {name, template} gives chat_template.jinja for "default", chat_template.<name>.jinja for each
    other, and the default (not the list) as the tokenizer IR's rt_info chat_template."""
    import openvino as ov

    plain = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
    checkpoint = chatml_checkpoint(stories, tmp_path / "ckpt", [{"name": "default", "template": CHATML},
                                                                 {"name": "plain", "template": plain}])
    (tmp_path / "out").mkdir()
    files, chat = convert_tokenizer(checkpoint, tmp_path / "out")
    assert chat is not None and chat.named == {"plain": "chat_template.plain.jinja"}
    assert {"chat_template.jinja", "chat_template.plain.jinja"} <= set(files)
    assert (tmp_path / "out" / "chat_template.plain.jinja").read_text() == plain
    model = ov.Core().read_model(tmp_path / "out" / names.TOKENIZER_XML)
    assert model.get_rt_info(names.CHAT_TEMPLATE_RT_INFO).astype(str) == CHATML


def test_a_template_without_an_end_of_turn_token_gives_none(hf, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """A template that writes no special token after an assistant message has no end-of-turn id, and says so."""
    assert end_of_turn_ids(hf, "{% for message in messages %}{{ message['content'] }}\n{% endfor %}") == ()
    assert "no end-of-turn token" in caplog.text
    assert end_of_turn_ids(hf, "{{ raise_exception('system message first') }}") == ()


def test_template_globals_and_errors_match_transformers(hf) -> None:  # noqa: ANN001
    """strftime_now, tojson (HTML left alone), loop controls and {% generation %} render as in transformers;
    raise_exception becomes an OvshardError carrying the template's message."""
    template = ("{{ strftime_now('%Y') }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}")
    conversation = [{"role": "user", "content": "<a & b>"}, {"role": "user", "content": "dropped"}]
    ours = ChatTemplate(template, hf.special_tokens_map).render(conversation)
    assert ours == hf.apply_chat_template(conversation, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert ours.startswith(str(datetime.now().year)) and "<a & b>" in ours
    with pytest.raises(OvshardError, match="refused the conversation: roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}", {}).render(conversation)


def test_missing_jinja2_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without jinja2, rendering raises an OvshardError naming the extra to install."""
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(OvshardError, match=r"needs jinja2: pip install 'ovshard\[api\]'"):
        ChatTemplate("{{ bos_token }}", {"bos_token": "<s>"}).render([])


def test_gemma_prompt_ids_equal_transformers(gemma_hf_reference: Path, tmp_path: Path) -> None:  # noqa: F811
    """On the real Gemma 3 270M tokenizer and Gemma's template: <end_of_turn> ends a turn, and the chat prompt
    ids are transformers' apply_chat_template(tokenize=True) ids, with one <bos>."""
    import openvino as ov
    from transformers import AutoTokenizer

    from ovshard.runtime.client.chat_template import compile_plain_tokenizer

    checkpoint = tmp_path / "gemma"
    checkpoint.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).symlink_to(gemma_hf_reference / name)
    (checkpoint / names.CHAT_TEMPLATE).write_text(GEMMA3)
    (tmp_path / "out").mkdir()
    _, chat = convert_tokenizer(checkpoint, tmp_path / "out")
    hf = AutoTokenizer.from_pretrained(checkpoint)
    assert chat is not None and chat.end_of_turn_ids == (hf.convert_tokens_to_ids("<end_of_turn>"),)
    tokenizer = compile_plain_tokenizer(ov.Core(), tmp_path / "out" / names.TOKENIZER_XML)
    template = ChatTemplate((tmp_path / "out" / chat.template).read_text(), chat.special_tokens)
    for conversation in ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
                         CONVERSATIONS[2]):
        rendered = template.render(conversation)
        assert rendered == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids = tokenizer([rendered])["input_ids"][0].tolist()
        assert ids == hf.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
        assert ids.count(hf.bos_token_id) == 1
