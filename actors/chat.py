"""The chat template around actions, as token ids, computed once per tokenizer.

An action's tokens are the engine's own (token in, token out); everything around them (the end of
the assistant's turn, the next user or tool message, the next generation prompt) is rendered
with the model's chat template and tokenized here, as observation tokens.
"""

from __future__ import annotations

from typing import Any

MARK = "\u2063"  # an invisible separator used to locate the assistant's text in a rendered template


class ChatFormat:
    """Token ids of the chat template around actions, computed once per tokenizer.

    ``prompt(obs)`` is the start of a conversation up to the assistant's turn; ``turn(obs, ended)``
    is what follows an assistant action: its end-of-turn marker (unless the engine already sampled
    it), the observation as the next user message, and the next generation prompt.
    """

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        user = [{"role": "user", "content": "x"}]
        one = self._render(user + [{"role": "assistant", "content": MARK}])
        self.end_of_turn = one[one.index(MARK) + len(MARK) :]
        candidates = [
            tokenizer.convert_tokens_to_ids("<|im_end|>"),
            tokenizer.eos_token_id,
        ]  # end of turn first
        self.stop_token_ids = list(
            dict.fromkeys(
                i for i in candidates if isinstance(i, int) and i != tokenizer.unk_token_id
            )
        )

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        """An action's text, as its environment or agent reads it."""
        return self.tok.decode(token_ids, skip_special_tokens=True)

    def prompt(self, observation: str) -> list[int]:
        return self.conversation([{"role": "user", "content": observation}])

    def turn(self, observation: str, action_ids: list[int]) -> list[int]:
        return self.continuation([{"role": "user", "content": observation}], action_ids)

    def conversation(self, messages: list[dict]) -> list[int]:
        """A whole conversation up to the assistant's turn."""
        return self._ids(self._render(messages, generation_prompt=True))

    def continuation(self, messages: list[dict], action_ids: list[int]) -> list[int]:
        """What follows an assistant action that sampled `action_ids`: its end-of-turn marker
        (unless the engine sampled it), `messages`, and the next generation prompt."""
        stub = [{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}]
        text = self._render(stub + messages, generation_prompt=True)
        text = text[text.index(MARK) + len(MARK) :]
        if action_ids and action_ids[-1] in self.stop_token_ids:
            stop_text = self.tok.decode([action_ids[-1]], skip_special_tokens=False)
            text = text.removeprefix(stop_text)
        return self._ids(text)
