"""Every tensor, port and file name that ovshard puts in a graph or a bundle, in one place.

These are optimum-intel's names, so a one-stage bundle is an ordinary stateful OpenVINO LLM.
"""

from __future__ import annotations

from collections.abc import Iterable

INPUT_IDS = "input_ids"  # i64 [batch, seq]            stage 0 only
HIDDEN_STATES = "hidden_states"  # f32 [batch, seq, hidden]  input of stages > 0, output of stages < N-1
ATTENTION_MASK = "attention_mask"  # i64 [batch, past + seq]
POSITION_IDS = "position_ids"  # i64 [batch, seq]
BEAM_IDX = "beam_idx"  # i32 [batch]
LOGITS = "logits"  # f32 [batch, seq, vocab]          last stage only
# The paged form of a stage (converted by the runtime on loading, never stored; openvino-genai's names)
INPUTS_EMBEDS = "inputs_embeds"  # f32 [N, H]: a later stage's input once converted
PAST_LENS, SUBSEQUENCE_BEGINS, MAX_CONTEXT_LEN = "past_lens", "subsequence_begins", "max_context_len"
BLOCK_INDICES, BLOCK_INDICES_BEGINS = "block_indices", "block_indices_begins"
SAMPLED_ROWS = "sampled_tokens_indices"  # i64 [R]: the rows a sliced last stage computes logits for
LOGIT_ROWS = "logit_rows"  # i64 [1]: the rows of logits to compute; added by the runtime on loading, never stored
# friendly name of the constant cos/sin table PrecomputeRotaryPass writes; weight compression skips it
ROTARY_TABLE = "rotary_table"


def past_key(layer: int) -> str:
    """Input name of layer ``layer``'s past keys before the graph is made stateful."""
    return f"past_key_values.{layer}.key"


def past_value(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key(layer: int) -> str:
    """Output name of layer ``layer``'s keys (past + new) before the graph is made stateful."""
    return f"present.{layer}.key"


def present_value(layer: int) -> str:
    return f"present.{layer}.value"


def kv_pairs(layers: Iterable[int]) -> list[tuple[str, str]]:
    """(past input, present output) names of the given layers, key then value for each."""
    return [pair for i in layers for pair in ((past_key(i), present_key(i)), (past_value(i), present_value(i)))]


def stage_inputs(first: bool, layers: Iterable[int]) -> list[str]:
    """Inputs of a traced stage, in order (MakeStatefulKVPass later turns the KV ones into state)."""
    return [INPUT_IDS if first else HIDDEN_STATES, ATTENTION_MASK, POSITION_IDS, *(p for p, _ in kv_pairs(layers))]


def stage_outputs(last: bool, layers: Iterable[int]) -> list[str]:
    return [LOGITS if last else HIDDEN_STATES, *(p for _, p in kv_pairs(layers))]


# Ports between the pieces a streamed compile traces one by one and joins into a stage (never stage I/O).
PIECE_MASK = "attention.mask4d"  # f32 [batch, 1, seq, past + seq], 0 or the f32 minimum
PIECE_TEMPERATURE = "attention.temperature"  # f32 [batch, 1, seq, 1]: Llama 4's NoPE query scale
PIECE_NORMED = "final_norm.out"  # f32 [batch, seq, hidden]
PIECE_EMBEDDED = "embedding.out"  # f32 [batch, seq, hidden]: gathered rows before the embedding scale
PIECE_HEAD = "lm_head.out"  # f32 [batch, seq, vocab]: logits before final soft-capping
DEFAULT_TABLE = "default"  # the rotary table (and FULL the mask kind) a family with one of each uses
FULL_MASK = "full_attention"


def piece_cos(table: str) -> str:
    """The rotary cos [batch, seq, rotary_dim] of rotary table ``table`` (one, or one per layer type)."""
    return "rotary.cos" if table == DEFAULT_TABLE else f"rotary.{table}.cos"


def piece_sin(table: str) -> str:
    return "rotary.sin" if table == DEFAULT_TABLE else f"rotary.{table}.sin"


def piece_mask(kind: str) -> str:
    """The 4-D additive mask of attention kind ``kind`` (full, or sliding window)."""
    return PIECE_MASK if kind == FULL_MASK else f"{PIECE_MASK}.{kind}"


def piece_hidden(layer: int) -> str:
    """The hidden state entering decoder layer ``layer`` (leaving layer ``layer - 1``) inside a stage."""
    return f"hidden.{layer}"


MANIFEST_FILE = "manifest.json"
TOKENIZER_XML = "openvino_tokenizer.xml"
DETOKENIZER_XML = "openvino_detokenizer.xml"
CHAT_TEMPLATE = "chat_template.jinja"  # the default chat template, as transformers 5 saves it
CHAT_TEMPLATE_RT_INFO = "chat_template"  # the tokenizer IR's rt_info key that openvino-genai reads
# A one-stage bundle names its model as openvino_genai.LLMPipeline expects.
SINGLE_STAGE_XML = "openvino_model.xml"


def stage_xml(index: int, num_stages: int) -> str:
    return SINGLE_STAGE_XML if num_stages == 1 else f"stage_{index}.xml"


def named_chat_template(name: str) -> str:
    """File of the checkpoint's chat template ``name`` (other than the default), e.g. ``chat_template.tool_use.jinja``."""
    return f"chat_template.{name}.jinja"
