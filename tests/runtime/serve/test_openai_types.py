"""The API's shapes without HTTP: a text chunk's server-sent event from its template is the chunk's JSON."""

from __future__ import annotations

import json

from hypothesis import example, given
from hypothesis import strategies as st

from ovshard.runtime.serve.openai_types import Answer


@given(st.text(), st.text(min_size=1), st.booleans())
@example("a", "\x00text\x00", True)  # a model named like the template's marker
def test_a_text_events_template_gives_the_chunks_json_byte_for_byte(text: str, model: str, chat: bool) -> None:
    """Any text (quotes, backslashes, control characters, the template's own marker) in a chat or a text completion
    of any model name: the event is exactly ``data: <json of the chunk>`` and a blank line."""
    answer = Answer(model, chat)
    assert answer.text_event(text) == f"data: {json.dumps(answer.chunk(text, None))}\n\n".encode()
