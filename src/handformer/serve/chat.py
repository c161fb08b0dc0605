"""A run's chat template → the prompt text for a list of messages, as transformers renders it.

A Hugging Face folder's ``tokenizer_config.json`` carries a Jinja template
(``handformer convert --from hf`` keeps it in the run's ``config.json`` as ``chat_template``).
``transformers``' ``apply_chat_template`` renders it in a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension, a ``tojson`` filter that
keeps non-ASCII characters, and the globals ``raise_exception`` and ``strftime_now``; the
variables are ``messages``, ``add_generation_prompt``, the special tokens' strings
(``bos_token``, ``eos_token``, …) and ``tools``/``documents`` (None here). The same is done
here with ``jinja2`` directly (it comes with transformers; the package does not import
transformers). The rendered text is then encoded without adding special tokens — the
template wrote them.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

__all__ = ["ChatTemplate", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template refused the messages (its ``raise_exception``) or failed to render."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """``render(messages)`` → prompt text; ``special`` maps ``bos_token``, ``eos_token``, … to
    their strings. Raises ``ImportError`` without jinja2, ``ChatTemplateError`` for a
    template that does not compile."""

    def __init__(self, source: str, special: dict[str, str]) -> None:
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as err:
            raise ImportError("the chat endpoint renders the run's chat template with jinja2: "
                              "pip install jinja2 (it comes with transformers)") from err
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._errors: tuple[type[Exception], ...] = (jinja2.TemplateError,)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the run's chat template does not compile: {err}") from None
        self.special = special

    @classmethod
    def for_tokenizer(cls, source: str, tokenizer: Any) -> ChatTemplate:
        """The template with ``tokenizer``'s ``bos_token`` / ``eos_token`` / ``pad_token``
        strings, those it has."""
        special: dict[str, str] = {}
        backend = getattr(tokenizer, "backend", None)  # a Hugging Face tokenizer's
        for role, idx in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                          ("pad_token", getattr(tokenizer, "pad_token_id", None))):
            token = None if idx is None or backend is None else backend.id_to_token(idx)
            if token is not None:
                special[role] = token
        return cls(source, special)

    def render(self, messages: list[dict[str, Any]], *,
               add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except ChatTemplateError:
            raise
        except (*self._errors, TypeError, ValueError, KeyError) as err:
            raise ChatTemplateError(f"the chat template could not render these messages: "
                                    f"{err}") from None
