"""What the compiler knows about a model, read once from its config.json into one typed object.

:func:`describe` is the only reader of a config.json's keys: it finds the family (``arch_for``), takes the
language model's config (a multimodal config's ``text_config``), and reads the dimensions, the decoder
block, the rotary tables and the special token ids. Everything downstream (tracer, stage module, rope,
planner, compile, stream, GGUF reader, synth) takes the :class:`ModelDescription`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from ovshard.bundle.dims import ModelDims
from ovshard.errors import CheckpointError, UnsupportedArchitectureError
from ovshard.frontend.arch import ArchSpec, arch_for, read_dims
from ovshard.frontend.block import Block, RopeTable, read_block, read_rope

TokenIds = int | tuple[int, ...] | None


@dataclass(frozen=True)
class ModelDescription:
    """A checkpoint's family, dimensions, block, rotary tables and special token ids, from its config.json."""

    arch: ArchSpec
    dims: ModelDims
    block: Block
    rope: Mapping[str, RopeTable]  # by rotary table key (``Block.rope_keys``): the tables some layer reads
    bos_token_id: TokenIds  # config.json's; generation_config.json, where present, takes precedence
    eos_token_id: TokenIds
    pad_token_id: TokenIds
    # tensor name prefixes a checkpoint may hold that the language model never reads: other towers (vision) and
    # multi-token-prediction layers stored after the last
    unread_prefixes: tuple[str, ...]
    # The language model's config as read, handed whole to transformers' rope init functions (which take a
    # transformers config object); nothing in ovshard reads its keys.
    language_config: Mapping[str, Any] = field(compare=False, repr=False)


def describe(config: Mapping[str, Any]) -> ModelDescription:
    """Read ``config`` (a config.json's object) once; refuse a family, key or value ovshard cannot compute."""
    config = dict(config)
    _refuse_prequantized(config)
    spec = arch_for(config)
    text = language_config(spec, config)
    dims = read_dims(spec, text)
    block = read_block(spec, text, dims)
    dims = replace(dims, attention_chunk=block.attention_chunk or 0)  # the manifest's: paged stages refuse it
    return ModelDescription(
        arch=spec, dims=dims, block=block,
        rope=MappingProxyType(read_rope(spec, text, block, dims)),
        bos_token_id=_token_ids(config.get("bos_token_id")),
        eos_token_id=_token_ids(config.get("eos_token_id")),
        pad_token_id=_token_ids(config.get("pad_token_id")),
        unread_prefixes=unread_prefixes(spec, text, dims.num_layers),
        language_config=MappingProxyType(copy.deepcopy(text)),
    )


def _refuse_prequantized(config: dict[str, Any]) -> None:
    """A checkpoint whose weights are stored quantized (GPTQ, AWQ, MXFP4 ...): ovshard reads float weights."""
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum, in a config it built
    # "gguf": transformers' mark on a config read from a GGUF file, whose weights it hands over dequantized
    if quant and method != "gguf" and not (isinstance(quant, dict) and quant.get("dequantize")):
        raise UnsupportedArchitectureError(
            f"config.json has a quantization_config (quant_method={method!r}): the weights are stored pre-quantized "
            "and ovshard reads floating-point checkpoints (its compile quantizes them itself). Dequantize first "
            "(gpt-oss's MXFP4 experts: transformers from_pretrained with Mxfp4Config(dequantize=True), then "
            "save_pretrained), or start from a floating-point release."
        )


def _token_ids(value: Any) -> TokenIds:
    """One id, several (a list in JSON), or None, as config.json gives them."""
    return tuple(value) if isinstance(value, list) else value


def unread_prefixes(spec: ArchSpec, config: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Tensor name prefixes the language model never reads: other towers, and multi-token-prediction layers
    (``spec.mtp_layers_key``: GLM-4.5 stores one after its last layer, which transformers drops too)."""
    extra = int(config.get(spec.mtp_layers_key) or 0) if spec.mtp_layers_key else 0
    layer = spec.input_norm.split("{i}")[0]  # "model.layers."
    return spec.ignored_prefixes + tuple(f"{layer}{i}." for i in range(layers, layers + extra))


def language_config(spec: ArchSpec, config: dict[str, Any]) -> dict[str, Any]:
    """The config of the language model: ``config`` itself, or a multimodal config's ``text_config``."""
    if not spec.text_config:
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"a {spec.family} config.json must hold a 'text_config' object, the language model's")
    merged = dict(text)
    merged.setdefault("model_type", f"{spec.family}_text")
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in config and key not in text:
            merged[key] = config[key]
    return merged
