"""The tokens that carry an operator's result back to the policy, as the chat template renders them.

After an assistant turn (which ends with the end-of-turn token the policy sampled, `<|im_end|>` for
Qwen), the observation is a `tool` message whose content is `<info>TEXT</info>` (docs/paper.md, The
multi-turn protocol), followed by the header of the next assistant turn. For Qwen2.5's template that
is

    "\\n<|im_start|>user\\n<tool_response>\\n<info>TEXT</info>\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"

The text is not hard-coded: `ObservationTemplate` renders a conversation with the checkpoint's own
chat template once, with placeholders, and keeps what the template puts between the end of an
assistant message and the start of the next one's content. So the token stream of an episode is
exactly `apply_chat_template` of its conversation (the leading "\\n" is the newline the template
writes after every `<|im_end|>`; the authors' loop drops it, which `template_newline=False`
reproduces: docs/paper.md, Our choices), and any chat template with the same structure works (the
tiny byte-level tokenizer of the tests too).
"""
from __future__ import annotations

from typing import Any

_ASSISTANT = "\x00ASSISTANT\x00"
_INFO = "\x00INFO\x00"


class ObservationTemplate:
    """Renders observation blocks for one tokenizer.

    Args:
      tokenizer: an HF tokenizer with a chat template whose assistant messages end with
        `end_of_turn` (the token text the policy samples to end its turn).
      end_of_turn: that token's text (default: the tokenizer's eos_token, `<|im_end|>` for Qwen).
      template_newline: keep the newline the template writes after the assistant's end-of-turn
        token (False: the release's stream, without it).
    """

    def __init__(self, tokenizer: Any, end_of_turn: str | None = None, template_newline: bool = True):
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn or tokenizer.eos_token
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                    {"role": "assistant", "content": _ASSISTANT}, {"role": "tool", "content": _INFO}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        anchor = _ASSISTANT + self.end_of_turn
        if anchor not in text or _INFO not in text:
            raise ValueError(f"the tokenizer's chat template does not end assistant messages with {self.end_of_turn!r} "
                             "or drops tool messages; pass end_of_turn= or use a chat model's tokenizer")
        between = text[text.index(anchor) + len(anchor):]
        self.prefix, self.suffix = between.split(_INFO)
        if not template_newline and self.prefix.startswith("\n"):
            self.prefix = self.prefix[1:]

    def text(self, info_block: str) -> str:
        """The observation text for one tool message content (`<info>...</info>`)."""
        return self.prefix + info_block + self.suffix

    def ids(self, info_block: str) -> list[int]:
        """Token ids of `text(info_block)`; the template writes its special tokens as text."""
        return [int(t) for t in self.tokenizer.encode(self.text(info_block), add_special_tokens=False)]
