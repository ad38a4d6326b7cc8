"""The checkpoint's chat template as bundle files and a manifest record (compile time, with transformers).

transformers finds the template wherever the checkpoint keeps it: ``tokenizer_config.json`` ``chat_template``
(a string, or a list of ``{name, template}``), ``chat_template.jinja`` and ``additional_chat_templates/``
beside it, or a GGUF file's ``tokenizer.chat_template`` (which :meth:`GGUFCheckpoint.export_tokenizer`
saves as ``chat_template.jinja``). This module writes the default template to ``chat_template.jinja`` and
each other one to ``chat_template.<name>.jinja``, and records the special tokens the template reads.

**The end-of-turn rule.** transformers renders the conversation ``[user "Hi", assistant PROBE]``; the
text right after PROBE, less leading whitespace, starts with what ends an assistant turn. The longest
special token it starts with (an added token marked ``special``, or a named one such as ``eos_token``)
is the end-of-turn token: ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``,
Phi-3's ``<|end|>``, Mistral's ``</s>`` (its eos). A template that raises on that conversation, drops
the message, or writes no special token after it gives none, with a warning: generation then stops on
the eos ids alone.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from ovshard.bundle import names, staging
from ovshard.bundle.manifest import Chat, sha256_file

log = logging.getLogger(__name__)

PROBE = "ovshardprobe"  # the assistant message of the end-of-turn rule: one word, which no template trims
PROBE_CONVERSATION = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE})
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9_-]+")  # names that make a safe file name


def write_chat(hf_tokenizer: Any, out_dir: Path) -> Chat | None:
    """Write the tokenizer's chat templates into ``out_dir``; their record, or None when it has none."""
    templates = chat_templates(hf_tokenizer)
    if templates is None:
        return None
    default, others = templates
    files = {names.CHAT_TEMPLATE: default}
    named = {}
    for name, text in others.items():
        if not TEMPLATE_NAME.fullmatch(name):
            log.warning("leaving out the chat template %r: expected a name of letters, digits, _ and -", name)
            continue
        named[name] = names.named_chat_template(name)
        files[named[name]] = text
    for file, text in files.items():
        staging.write_bytes(out_dir / file, text.encode("utf-8"))  # bytes: no newline translation
    return Chat(template=names.CHAT_TEMPLATE, named=named,
                sha256={file: sha256_file(out_dir / file) for file in files},
                special_tokens=dict(hf_tokenizer.special_tokens_map),
                end_of_turn_ids=end_of_turn_ids(hf_tokenizer, default))


def chat_templates(hf_tokenizer: Any) -> tuple[str, dict[str, str]] | None:
    """(the default template, the others by name), or None when the tokenizer has no usable template."""
    found = hf_tokenizer.chat_template
    if found is None:
        return None
    if isinstance(found, str):
        return found, {}
    if not isinstance(found, dict) or not all(isinstance(t, str) for t in found.values()):
        log.warning("leaving out the chat template: expected a string or templates by name, found %s",
                    type(found).__name__)
        return None
    if "default" not in found:
        log.warning("leaving out the chat templates %s: none is named 'default', which --chat and "
                    "openvino-genai use; name one 'default' in tokenizer_config.json", sorted(found))
        return None
    return found["default"], {name: t for name, t in found.items() if name != "default"}


def end_of_turn_ids(hf_tokenizer: Any, template: str) -> tuple[int, ...]:
    """The special token ``template`` writes right after an assistant message (the rule above), as ids."""
    try:
        text = hf_tokenizer.apply_chat_template(list(PROBE_CONVERSATION), chat_template=template, tokenize=False)
    except Exception as e:  # a template raises whatever it likes (jinja2.TemplateError, TypeError ...)
        log.warning("the chat template refuses a user-assistant conversation (%s: %s); no end-of-turn token "
                    "found: generation stops on the eos ids only", type(e).__name__, e)
        return ()
    at = text.rfind(PROBE)
    after = text[at + len(PROBE):].lstrip() if at >= 0 else ""
    special = {t.content: i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}
    for token in hf_tokenizer.special_tokens_map.values():
        special.setdefault(token, hf_tokenizer.convert_tokens_to_ids(token))
    ending = max((t for t in special if t and after.startswith(t)), key=len, default=None)
    if ending is None:
        log.warning("the chat template writes no special token after an assistant message (%r); no "
                    "end-of-turn token found: generation stops on the eos ids only", after[:40])
        return ()
    log.info("chat template: an assistant turn ends with %s (id %d)", ending, special[ending])
    return (int(special[ending]),)
