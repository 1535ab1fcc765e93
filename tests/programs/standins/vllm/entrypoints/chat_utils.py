"""Stand-in of vLLM's ``vllm/entrypoints/chat_utils.py``: the chat template is rendered with jinja2,
synchronously, in the caller's thread. vLLM's API server called it from its async request handler
(the event loop's thread) until vLLM PR #38157 moved rendering off the loop: a template that renders
for long blocks every request, ``/health`` and ``/metrics`` included."""

from __future__ import annotations

from typing import Any

import jinja2


def apply_hf_chat_template(messages: list[dict[str, Any]], chat_template: str) -> str:
    """The prompt ``chat_template`` renders for ``messages`` (a real jinja2 render, sandboxed as
    transformers renders chat templates)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return env.from_string(chat_template).render(messages=messages, add_generation_prompt=True)
