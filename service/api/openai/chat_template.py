"""The chat template of the GPT, a model trained on plays (tinyshakespeare): a conversation is rendered as a
scene, every message a speaker's turn as the training text writes them, and the model is asked for the next turn:

    <system and developer messages, one paragraph each>

    ROMEO:
    <a user message>

    JULIET:
    <- the model continues here; its turn ends at the first blank line (an implicit stop string)

A message's `name` replaces its role's speaker (e.g. {"role": "user", "name": "HAMLET", ...}). Blank lines inside a
message would end its turn early, so runs of them become one line break. A longer conversation: the design notes,
docs/architecture.md, service/api/openai/chat_template.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

USER_SPEAKER = "ROMEO"
ASSISTANT_SPEAKER = "JULIET"
END_OF_TURN = "\n\n"  # the blank line after every speech in the play
_BLANK_LINES = re.compile(r"\n\s*\n")


def message_text(content) -> str:
    """A message's content: a string, or text parts joined."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def render(messages: Sequence, assistant_name: str | None = None) -> str:
    """The prompt for the next assistant turn (messages: objects with `role`, `content`, `name`)."""
    paragraphs = []
    for message in messages:
        text = _BLANK_LINES.sub("\n", message_text(message.content).strip())
        if message.role in ("system", "developer"):
            paragraphs.append(text)
        else:
            default = USER_SPEAKER if message.role == "user" else ASSISTANT_SPEAKER
            paragraphs.append(f"{message.name or default}:\n{text}")
    return "".join(p + END_OF_TURN for p in paragraphs) + f"{assistant_name or ASSISTANT_SPEAKER}:\n"
