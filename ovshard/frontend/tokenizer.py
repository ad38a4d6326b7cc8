"""Tokenizer and detokenizer as OpenVINO models, via openvino-tokenizers (compile time only)."""

from __future__ import annotations

import logging
from pathlib import Path

from ovshard.bundle import names, staging
from ovshard.bundle.manifest import Chat
from ovshard.frontend.chat import write_chat
from ovshard.ir.naming import stable_names

log = logging.getLogger(__name__)


def convert_tokenizer(checkpoint_dir: Path, out_dir: Path) -> tuple[list[str], Chat | None]:
    """Write openvino_tokenizer.xml/.bin, openvino_detokenizer.xml/.bin and the chat templates; return the
    files written and the chat template's record (None when the checkpoint has none).

    Returns ([], None) with a warning when the checkpoint has no tokenizer or it cannot be converted: the
    bundle is still usable with token ids. The default chat template is also set as both IRs' rt_info
    ``chat_template``, where openvino-genai reads it (openvino-tokenizers sets it only for a single template).
    """
    from openvino_tokenizers import convert_tokenizer as ov_convert
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    except (OSError, ValueError) as e:
        log.warning("no tokenizer in %s (%s); the bundle will take and return token ids only", checkpoint_dir, e)
        return [], None
    try:
        tokenizer, detokenizer = ov_convert(hf_tokenizer, with_detokenizer=True)
    except Exception as e:  # openvino-tokenizers raises many types for unsupported tokenizers
        log.warning("could not convert the tokenizer of %s to OpenVINO (%s: %s); the bundle will take "
                    "token ids only", checkpoint_dir, type(e).__name__, e)
        return [], None
    chat = write_chat(hf_tokenizer, out_dir)
    written = [*chat.sha256] if chat else []
    for model, xml in ((tokenizer, names.TOKENIZER_XML), (detokenizer, names.DETOKENIZER_XML)):
        if chat is not None:
            model.set_rt_info((out_dir / chat.template).read_bytes().decode("utf-8"), names.CHAT_TEMPLATE_RT_INFO)
        stable_names(model)  # counter-based default names would make the XML differ from one process to the next
        staging.save_model(model, out_dir / xml, compress_to_fp16=True)  # ov.save_model's default
        written += [xml, xml.replace(".xml", ".bin")]
    return written, chat
