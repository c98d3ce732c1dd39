"""The chat template the server gives a tokenizer that has none (the embedded model), and the response template that
goes with it."""

from __future__ import annotations

# The embedded model has no chat template of its own: this plain template renders messages in the prompt format it
# was trained on ("Question: ...\nAnswer:"), a system message as a plain first line. Stated as such in docs/serve.md.
PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Question: {{ m['content'] }}\n"
    "{% else %}Answer: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Answer:{% endif %}"
)

# ... and the response template that goes with it (transformers' hook for parsing a reply: without one it would use
# its Qwen3 fallback for this model type, which looks for "<|im_start|>assistant"): the reply is the text after the
# prompt's "Answer:", up to end-of-text, its surrounding whitespace stripped as chat replies are (a stream strips it
# too: stream_text.py).
PLAIN_RESPONSE = {"defaults": {"role": "assistant"}, "start_anchor": "Answer:",
                  "fields": {"content": {"close_pattern": r"<\|endoftext\|>", "content": "text"}}}


def install_plain_template(tokenizer) -> None:
    """Give ``tokenizer`` the plain chat and response templates when it has no chat template of its own."""
    if getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template, tokenizer.response_template = PLAIN_TEMPLATE, PLAIN_RESPONSE
