"""Chat templates: the package's Jinja template, rendered in a sandbox when jinja2 is
installed; otherwise a built-in ChatML renderer for ``<|im_start|>`` templates.

jinja2 is optional (not a dependency of the runtime). Without it, a template that is
ChatML-shaped renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message plus
``<|im_start|>assistant\\n``, and a default system message the template inserts when the
conversation has none (SmolLM2, Qwen2) is taken from the template text. Other templates
need jinja2 (:class:`~.errors.ChatTemplateError`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ChatTemplateError

__all__ = ["render_chat", "render_chatml"]

_DEFAULT_SYSTEM = re.compile(
    r"""['"]<\|im_start\|>system\n(?P<text>(?:(?!<\|im_end\|>).)*)<\|im_end\|>\\?n?""", re.S
)


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    engine: str = "auto",
) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}]``) to the prompt text.

    ``engine``: ``"jinja2"``, ``"builtin"`` or ``"auto"`` (jinja2 when installed)."""
    _check_messages(messages)
    if template is None:
        raise ChatTemplateError("the package has no chat template")
    use_jinja = engine == "jinja2"
    if engine == "auto":
        try:
            import jinja2  # noqa: F401
        except ImportError:
            use_jinja = False
        else:
            use_jinja = True
    if use_jinja:
        return _render_jinja(template, messages, add_generation_prompt, bos_token, eos_token)
    if "<|im_start|>" not in template:
        raise ChatTemplateError(
            "this chat template needs jinja2 (pip install jinja2); the built-in renderer "
            "only handles ChatML (<|im_start|>) templates"
        )
    m = _DEFAULT_SYSTEM.search(template)
    default_system = m.group("text").replace("\\n", "\n") if m else None
    return render_chatml(messages, add_generation_prompt, default_system)


def render_chatml(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    default_system: str | None = None,
) -> str:
    parts = []
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for msg in messages:
        parts.append(f"<|im_start|>{msg['role']}\n{msg['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content'")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


@functools.lru_cache(maxsize=16)
def _compiled(template: str):  # -> jinja2.Template
    """The template compiled once (compiling costs milliseconds; a chat renders every
    turn). A template that does not compile raises, and is not cached."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _render_jinja(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
) -> str:
    import jinja2

    try:
        return _compiled(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from None
