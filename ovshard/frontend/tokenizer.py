"""Tokenizer and detokenizer as OpenVINO models, via openvino-tokenizers (compile time only)."""

from __future__ import annotations

import logging
from pathlib import Path

import openvino as ov

from ovshard.bundle import names
from ovshard.ir.naming import stable_names

log = logging.getLogger(__name__)


def convert_tokenizer(checkpoint_dir: Path, out_dir: Path) -> list[str]:
    """Write openvino_tokenizer.xml/.bin and openvino_detokenizer.xml/.bin; return the files written.

    Returns [] with a warning when the checkpoint has no tokenizer or it cannot be converted: the
    bundle is still usable with token ids.
    """
    from openvino_tokenizers import convert_tokenizer as ov_convert
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    except (OSError, ValueError) as e:
        log.warning("no tokenizer in %s (%s); the bundle will take and return token ids only", checkpoint_dir, e)
        return []
    try:
        tokenizer, detokenizer = ov_convert(hf_tokenizer, with_detokenizer=True)
    except Exception as e:  # openvino-tokenizers raises many types for unsupported tokenizers
        log.warning("could not convert the tokenizer of %s to OpenVINO (%s: %s); the bundle will take "
                    "token ids only", checkpoint_dir, type(e).__name__, e)
        return []
    written = []
    for model, xml in ((tokenizer, names.TOKENIZER_XML), (detokenizer, names.DETOKENIZER_XML)):
        stable_names(model)  # counter-based default names would make the XML differ from one process to the next
        ov.save_model(model, out_dir / xml)
        written += [xml, xml.replace(".xml", ".bin")]
    return written
