"""Chat templates: render ``tokenizer.chat_template`` (untrusted Jinja) into a prompt string.

The template comes from the model file, so it is treated as hostile: it runs in Jinja's
ImmutableSandboxedEnvironment with HF's settings (``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension) and helpers (``raise_exception``, ``tojson``, ``strftime_now``,
``bos_token``, ``eos_token``), and with limits on time and size:

* a deadline, checked between output chunks, at every call, attribute lookup and every 256
  items of ``range``;
* the output size, checked between chunks;
* amplifying operations are checked *before* they allocate: ``*``, ``+`` and ``%`` on strings
  and lists, ``**``, ``range``, ``str`` padding/replacing methods and filters, and values
  stored in a ``namespace``; none may produce more than the output limit.

Every failure (syntax error, ``raise_exception``, sandbox violation, limit) is a
:class:`ChatTemplateError` with one line saying what went wrong.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from .errors import BloomeryError

MAX_SECONDS = 2.0
MAX_OUTPUT_CHARS = 1 << 20
MAX_RANGE = 100_000
_RANGE_CHECK_EVERY = 256


# A ChatML template in the shape of Qwen's: system prompt, tool list, tool calls and tool
# results, optional generation prompt.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call these functions. Their signatures are inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, answer with a JSON object {\"name\": ..., \"arguments\": ...} "
    "inside <tool_call></tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Gemma's turn format (the embedded default model's file carries no template): BOS, the system
# prompt folded into the first user turn, "model" for the assistant, roles must alternate.
GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set prefix = messages[0].content | trim + '\n\n' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set prefix = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('conversation roles must alternate user/assistant/user/...') }}"
    "{%- endif %}"
    "{{- '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) + '\n' }}"
    "{{- (prefix if loop.first else '') + message.content | trim + '<end_of_turn>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)


class ChatTemplateError(BloomeryError, ValueError):
    """A chat template that does not compile, raises, breaks the sandbox or exceeds a limit."""


class _Limits:
    """Per-render deadline and size budget, shared by the environment's hooks."""

    def __init__(self, max_seconds: float, max_chars: int):
        self.max_seconds = max_seconds
        self.max_chars = max_chars
        self.deadline = float("inf")

    def start(self) -> None:
        self.deadline = time.monotonic() + self.max_seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template ran longer than {self.max_seconds:g} s")

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise ChatTemplateError(f"chat template {what} would make {n} items (limit {self.max_chars})")


# str methods whose result can be much longer than their inputs, and how long it would be.
def _padded(s: str, width: Any = 0, *_: Any) -> int:
    return max(len(s), width if isinstance(width, int) else 0)


def _replaced(s: str, old: Any = "", new: Any = "", *_: Any) -> int:
    if not (isinstance(old, str) and isinstance(new, str)):
        return len(s)
    hits = s.count(old) if old else len(s) + 1  # an empty ``old`` matches between all characters
    return len(s) + hits * max(len(new) - len(old), 0)


def _expanded(s: str, tab: Any = 8, *_: Any) -> int:
    return len(s) + s.count("\t") * max(tab if isinstance(tab, int) else 8, 0)


_STR_GROWTH = {"center": _padded, "ljust": _padded, "rjust": _padded, "zfill": _padded,
               "expandtabs": _expanded, "replace": _replaced}
_FORMAT_WIDTH = re.compile(r"%[-+ #0]*(\*|\d{6,})")  # a '*' width or one of 100000+ characters


def _namespace_class(limits: _Limits) -> type:
    """``namespace()`` whose attributes obey the size limit (templates grow strings in loops)."""

    class namespace(jinja2.utils.Namespace):  # noqa: N801 (the name templates see)
        def __setitem__(self, name: str, value: Any) -> None:
            if isinstance(value, (str, list, tuple, dict)):
                limits.size(len(value), "namespace value")
            super().__setitem__(name, value)

    return namespace


# A str.format field with a width of 100000+ characters, or a width taken from an argument.
_FORMAT_FIELD_WIDTH = re.compile(r"\{[^{}]*:[^{}]*(\d{6,}|\{)")


class _Env(jinja2.sandbox.ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: _Limits):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.limits = limits

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise ChatTemplateError(
            f"chat template tried to access {attribute!r} of a {type(obj).__name__} (blocked by the sandbox)"
        )

    def wrap_str_format(self, value: Any):
        fmt = super().wrap_str_format(value)
        if fmt is not None and _FORMAT_FIELD_WIDTH.search(value.__self__):
            raise ChatTemplateError("chat template str.format with a huge or computed width is not allowed")
        return fmt

    def getattr(self, obj: Any, attribute: str):
        self.limits.tick()
        return super().getattr(obj, attribute)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        __self.limits.tick()
        growth = _STR_GROWTH.get(getattr(__obj, "__name__", ""))
        if growth is not None and isinstance(getattr(__obj, "__self__", None), str):
            __self.limits.size(growth(__obj.__self__, *args), f"str.{__obj.__name__}")
        for a in args:
            if isinstance(a, str):
                __self.limits.size(len(a), "call argument")
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, op: str, left: Any, right: Any):
        lim = self.limits
        if op == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                lim.size(len(seq) * max(n, 0), "repetition")
        elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            lim.size(len(left) + len(right), "concatenation")
        elif op == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 4096 or (abs(left) > 1 and right * max(abs(left), 2).bit_length() > 1 << 16):
                raise ChatTemplateError(f"chat template power {left} ** {right} is too large")
        elif op == "%" and isinstance(left, str) and _FORMAT_WIDTH.search(left):
            raise ChatTemplateError("chat template % format with a '*' or huge width is not allowed")
        return super().call_binop(context, op, left, right)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    # HF's version: plain json.dumps (Jinja's own filter HTML-escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str = "") -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template with its limits.

    Args:
      source: the Jinja source (``tokenizer.chat_template``).
      bos_token, eos_token: texts exposed to the template.
      max_seconds: wall-clock budget of one render.
      max_chars: largest output (and largest intermediate string or list) in characters.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 max_seconds: float = MAX_SECONDS, max_chars: int = MAX_OUTPUT_CHARS):
        if not isinstance(source, str):
            raise ChatTemplateError(f"chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self._limits = _Limits(max_seconds, max_chars)
        env = _Env(self._limits)
        env.globals.update(
            range=self._range, namespace=_namespace_class(self._limits), raise_exception=_raise_exception,
            strftime_now=_strftime_now,
        )
        env.filters["tojson"] = _tojson
        for name in ("center", "indent", "replace", "format", "wordwrap", "truncate"):
            env.filters[name] = self._guarded_filter(env.filters[name], name)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None

    @classmethod
    def from_tokenizer(cls, tokenizer, source: str | None = None, **limits) -> "ChatTemplate":
        """The template of a bloomery_jax.tokenizer.Tokenizer's file (or ``source``), with its BOS/EOS texts."""
        source = source if source is not None else tokenizer.vocab.chat_template
        if source is None:
            raise ChatTemplateError(f"{tokenizer.vocab.path}: the file has no tokenizer.chat_template")
        tokens = tokenizer.vocab.tokens
        bos = tokens[tokenizer.bos_id] if tokenizer.bos_id is not None else ""
        eos = tokens[tokenizer.eos_id] if tokenizer.eos_id is not None else ""
        return cls(source, bos_token=bos, eos_token=eos, **limits)

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for a conversation.

        Args:
          messages: [{"role": ..., "content": ..., optional "tool_calls": [...]}, ...].
          tools: tool (function) descriptions, or None.
          add_generation_prompt: end with the header of an assistant turn.
          extra: more template variables (e.g. ``enable_thinking``).
        Returns:
          the rendered text.
        """
        ctx = dict(extra, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                   bos_token=self.bos_token, eos_token=self.eos_token)
        lim = self._limits
        lim.start()
        parts, size = [], 0
        try:
            for chunk in self._template.generate(**ctx):
                size += len(chunk)
                lim.size(size, "output")
                lim.tick()
                parts.append(chunk)
        except ChatTemplateError:
            raise
        except jinja2.sandbox.SecurityError as e:
            raise ChatTemplateError(f"chat template blocked by the sandbox: {e}") from None
        except RecursionError:
            raise ChatTemplateError("chat template recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateError("chat template ran out of memory") from None
        except Exception as e:  # a template error of any kind is the template's fault
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        return "".join(parts)

    # --- guarded builtins ---------------------------------------------------------------------
    def _range(self, *args: int):
        n = len(range(*args))
        if n > MAX_RANGE:
            raise ChatTemplateError(f"chat template range of {n} items exceeds {MAX_RANGE}")
        return self._ticking(range(*args))

    def _ticking(self, items):
        for k, item in enumerate(items):
            if k % _RANGE_CHECK_EVERY == 0:
                self._limits.tick()
            yield item

    def _guarded_filter(self, fn, name: str):
        lim = self._limits

        pass_arg = getattr(fn, "jinja_pass_arg", None)  # then args[0] is Jinja's context

        def guarded(*args, **kwargs):
            own = args[1:] if pass_arg is not None else args
            value = own[0] if own else ""
            text = value if isinstance(value, str) else str(value)
            rest = list(own[1:]) + list(kwargs.values())
            if name == "center":
                lim.size(_padded(text, *rest[:1]), "center filter")
            elif name == "indent":
                width = rest[0] if rest and isinstance(rest[0], int) else 4
                lim.size(len(text) + (text.count("\n") + 1) * max(width, 0), "indent filter")
            elif name == "replace":
                lim.size(_replaced(text, *rest[:2]), "replace filter")
            elif name == "format" and _FORMAT_WIDTH.search(text):
                raise ChatTemplateError("chat template format with a '*' or huge width is not allowed")
            result = fn(*args, **kwargs)
            if isinstance(result, str):
                lim.size(len(result), f"{name} filter")
            return result

        if pass_arg is not None:
            guarded.jinja_pass_arg = pass_arg
        return guarded

