"""Chat templates at run time: render a conversation with jinja2, tokenize it once, stop at the end of a turn.

No transformers here. The template is rendered as transformers' ``apply_chat_template`` renders it: a
jinja2 ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the loop controls
extension, a ``{% generation %}`` block that renders its body, a ``tojson`` that does not escape HTML,
the globals ``raise_exception`` and ``strftime_now``, and the named special tokens (``bos_token``,
``eos_token`` ...) as variables. Messages whose values are None lose those keys first, as transformers does.

The rendered text already holds every special token the model expects (``<bos>`` included, where the
template writes one), so it is tokenized with the tokenizer's own special tokens turned off: transformers'
``add_special_tokens=False``, which ``apply_chat_template(tokenize=True)`` uses. :func:`plain_tokenizer`
does that to the bundle's OpenVINO tokenizer as openvino-genai does: the begin/end of every constant
segment of ``CombineSegments`` (the tokens the post-processor adds, e.g. BOS) becomes 0.

jinja2 is imported only when a template is rendered, so a node that never chats needs none
(``pip install 'ovshard[api]'``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import openvino as ov

from ovshard.bundle.manifest import Manifest
from ovshard.errors import OvshardError

NEEDS_JINJA = "rendering a chat template (--chat) needs jinja2: pip install 'ovshard[api]'"


class ChatTemplate:
    """One chat template and the special tokens it reads, rendered with a sandboxed jinja2."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._compiled: Any = None

    @classmethod
    def from_manifest(cls, bundle: str | Path, manifest: Manifest, name: str | None = None) -> ChatTemplate:
        """The bundle's default template (or the one named ``name``); OvshardError when there is none."""
        chat = manifest.chat
        if chat is None:
            raise OvshardError(f"bundle {bundle} has no chat template: its checkpoint had none (no chat_template "
                               "in tokenizer_config.json, no chat_template.jinja); leave out --chat, or compile a "
                               "checkpoint that has one")
        if name is not None and name not in chat.named:
            raise OvshardError(f"bundle {bundle} has no chat template named {name!r}; it has the default"
                               + "".join(f", {n!r}" for n in sorted(chat.named)))
        file = Path(bundle) / (chat.template if name is None else chat.named[name])
        try:
            source = file.read_bytes().decode("utf-8")
        except OSError as e:
            raise OvshardError(f"cannot read the chat template {file} ({e.strerror}); copy the whole bundle "
                               "folder or recompile") from e
        return cls(source, chat.special_tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model reads it, ending with the assistant's header when asked."""
        jinja2 = _jinja()
        try:
            if self._compiled is None:
                self._compiled = _environment(jinja2).from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise OvshardError(f"the bundle's chat template is not valid jinja ({e}, line {e.lineno}); fix the "
                               "checkpoint's chat_template and recompile") from e
        conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return str(self._compiled.render(**self.special_tokens, messages=conversation, tools=None,
                                             documents=None, add_generation_prompt=add_generation_prompt))
        except jinja2.TemplateError as e:
            raise OvshardError(f"the chat template refused the conversation: {e}; expected messages it "
                               "accepts (roles such as system, user, assistant)") from e

    def clean(self, text: str) -> str:
        """``text`` without any named special token (``<bos>``, ``</s>`` ...) a detokenizer let through."""
        for token in sorted(set(self.special_tokens.values()), key=len, reverse=True):
            if token:
                text = text.replace(token, "")
        return text


def stop_ids(manifest: Manifest) -> tuple[int, ...]:
    """The ids a chat answer stops at: the generation config's eos ids, then the template's end-of-turn ids."""
    ends = manifest.chat.end_of_turn_ids if manifest.chat else ()
    return tuple(dict.fromkeys((*manifest.generation.eos_token_ids, *ends)))


def plain_tokenizer(model: ov.Model) -> ov.Model:
    """``model`` (an openvino-tokenizers tokenizer), changed in place to add no special tokens: HF's
    ``add_special_tokens=False``.

    ``CombineSegments`` takes (begin, end, ids) per segment and the segment types last; a segment of
    constants is tokens the post-processor adds, and an end equal to its begin adds none of them.
    """
    for node in model.get_ordered_ops():
        if node.get_type_name() != "CombineSegments":
            continue
        for start in range(0, node.get_input_size() - 1, 3):
            ports = [node.input(start + i).get_source_output() for i in range(3)]
            if all(p.get_node().get_type_name() == "Constant" for p in ports):
                node.input(start + 1).replace_source_output(ports[0])  # end = begin: an empty segment
    model.validate_nodes_and_infer_types()
    return model


def compile_plain_tokenizer(core: ov.Core, xml: Path) -> Any:
    """The tokenizer IR ``xml`` compiled on CPU without the special tokens it adds (:func:`plain_tokenizer`).

    OvshardError when it still adds some to an empty text: a tokenizer that adds them inside one op (the
    SentencePiece op of a slow tokenizer's conversion) would give the chat prompt a second BOS.
    """
    compiled = core.compile_model(plain_tokenizer(core.read_model(xml)), "CPU")
    added = [int(t) for t in compiled([""])["input_ids"][0]]
    if added:
        raise OvshardError(f"{xml} adds the tokens {added} to every text, and --chat cannot turn them off (they "
                           "are added outside a CombineSegments step): the chat prompt would hold them twice; "
                           "compile from a checkpoint with a fast tokenizer (tokenizer.json)")
    return compiled


def _jinja() -> Any:
    """The jinja2 module, imported on first use; OvshardError saying how to install it when it is missing."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as e:
        raise OvshardError(NEEDS_JINJA) from e
    return jinja2


def _environment(jinja2: Any) -> Any:
    """The sandbox transformers renders chat templates in, rebuilt from jinja2's parts."""

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's tokens for training): its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str) -> None:
    raise _jinja().exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """JSON as the template wrote it: jinja2's own ``tojson`` escapes <, > and & for HTML."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)

