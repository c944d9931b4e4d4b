"""Chat templates: exact output of the ChatML and Gemma templates (checked-in strings written
from the templates' formats and compared with llama.cpp's own renderers of those formats), the
HF helpers, and the sandbox: escapes, raise_exception, endless loops and memory bombs."""

from __future__ import annotations

import ctypes
import time

import pytest

from bloomery_jax.chat import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplate, ChatTemplateError
from bloomery_jax.errors import BloomeryError

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "안녕? 😀"},
]

CHATML_EXPECTED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n"
    "<|im_start|>user\n안녕? 😀<|im_end|>\n"
    "<|im_start|>assistant\n"
)
GEMMA_EXPECTED = (
    "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
    "<start_of_turn>model\nHello.<end_of_turn>\n"
    "<start_of_turn>user\n안녕? 😀<end_of_turn>\n"
    "<start_of_turn>model\n"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Seoul?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "서울"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"wind": 3}'},
]
CHATML_TOOLS_EXPECTED = (
    "<|im_start|>system\n# Tools\n\nYou may call these functions. Their signatures are inside "
    "<tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "weather", "description": "Weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
    'To call one, answer with a JSON object {"name": ..., "arguments": ...} inside '
    "<tool_call></tool_call>.<|im_end|>\n"
    "<|im_start|>user\nWeather in Seoul?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "서울"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n"
    "{\"wind\": 3}\n</tool_response><|im_end|>\n"
)


def test_chatml_exact():
    t = ChatTemplate(CHATML_TEMPLATE, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    assert t.render(CONVERSATION) == CHATML_EXPECTED
    assert t.render(CONVERSATION, add_generation_prompt=False) == CHATML_EXPECTED.removesuffix(
        "<|im_start|>assistant\n")


def test_chatml_tools_exact():
    t = ChatTemplate(CHATML_TEMPLATE)
    assert t.render(TOOL_TURNS, tools=TOOLS, add_generation_prompt=False) == CHATML_TOOLS_EXPECTED


def test_gemma_exact_and_role_check():
    t = ChatTemplate(GEMMA_TEMPLATE, bos_token="<bos>", eos_token="<eos>")
    assert t.render(CONVERSATION) == GEMMA_EXPECTED
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def llamacpp_render(template: str, messages, add_ass: bool) -> str:
    """llama.cpp's built-in renderer for the format it detects in ``template``."""
    llama_cpp = pytest.importorskip("llama_cpp")
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    arr = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(keep), add_ass, buf, len(buf))
    assert 0 < n <= len(buf), n
    return buf.raw[:n].decode()


@pytest.mark.llamacpp
@pytest.mark.parametrize("add_ass", [False, True])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:], CONVERSATION[1:2]])
def test_matches_llamacpp_builtin_renderers(messages, add_ass):
    chatml = ChatTemplate(CHATML_TEMPLATE).render(messages, add_generation_prompt=add_ass)
    assert chatml == llamacpp_render(CHATML_TEMPLATE, messages, add_ass)
    # llama.cpp's gemma renderer leaves the BOS to the tokenizer.
    gemma = ChatTemplate(GEMMA_TEMPLATE, bos_token="<bos>").render(messages, add_generation_prompt=add_ass)
    assert gemma == "<bos>" + llamacpp_render(GEMMA_TEMPLATE, messages, add_ass)


def test_helpers():
    src = ("{{ raise_exception is defined }}|{{ {'k': 'é<>'} | tojson }}|{{ [1, 2] | tojson(indent=1) }}|"
           "{{ strftime_now('%Y') }}|{{ bos_token }}{{ eos_token }}|{{ tools | length }}|{{ extra }}|"
           "{% for x in range(3) %}{% if x == 1 %}{% continue %}{% endif %}{{ x }}{% endfor %}")
    out = ChatTemplate(src, bos_token="<s>", eos_token="</s>").render([], tools=[{}, {}], extra="E")
    assert out == f'True|{{"k": "é<>"}}|[\n 1,\n 2\n]|{time.strftime("%Y")}|<s></s>|2|E|02'


def test_trim_and_lstrip_blocks_like_hf():
    src = "{% for m in messages %}\n  {{ m.content }}\n{% endfor %}"
    assert ChatTemplate(src).render([{"content": "a"}, {"content": "b"}]) == "  a\n  b\n"


# --- the sandbox ----------------------------------------------------------------------------------
@pytest.mark.parametrize("src,match", [
    ("{{ ''.__class__ }}", "'__class__' of a str"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "blocked by the sandbox"),
    ("{{ cycler.__init__.__globals__.os }}", "blocked by the sandbox"),
    ("{{ lipsum.__globals__['os'].system('true') }}", "blocked by the sandbox"),
    ("{{ messages.append(1) }}", "'append' of a list"),
    ("{{ self.__init__ }}", "blocked by the sandbox"),
])
def test_escapes_are_blocked(src, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(src).render([{"role": "user", "content": "x"}])


def test_raise_exception_is_a_one_line_error():
    with pytest.raises(ChatTemplateError, match=r"^chat template raised: no tools allowed$") as e:
        ChatTemplate("{% if tools %}{{ raise_exception('no tools allowed') }}{% endif %}").render([], tools=[{}])
    assert isinstance(e.value, BloomeryError) and "\n" not in str(e.value)


def test_endless_loop_hits_the_deadline():
    src = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="ran longer than 0.3 s"):
        ChatTemplate(src, max_seconds=0.3).render([])
    assert time.monotonic() - start < 3  # stopped near the deadline, not after 10^10 steps


@pytest.mark.parametrize("src,match", [
    ("{% for i in range(10**9) %}{% endfor %}", "range of 1000000000 items"),
    ("{{ 'a' * 10**9 }}", "repetition"),
    ("{{ [0] * 10**9 }}", "repetition"),
    ("{{ 2 ** 100000000 }}", "too large"),  # Jinja reads a ** b ** c as (a ** b) ** c
    ("{{ 'x' | center(10**9) }}", "center filter"),
    ("{{ 'x'.ljust(10**9) }}", "str.ljust"),
    ("{{ 'ab' | replace('a', 'a' * 900000) | replace('a', 'a' * 900000) }}", "replace filter"),
    ("{{ '{0:>1000000000}'.format(1) }}", "str.format"),
    ("{{ '%*s' % (10**9, 'x') }}", "% format"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "namespace"),
    ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}", "call argument"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply|call"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output would make"),
])
def test_runaway_templates_are_stopped(src, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(src).render([])


def test_syntax_error_names_the_line():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}")


def test_missing_template_is_an_error(tmp_path):
    class _Vocab:
        path, chat_template, tokens = "m.gguf", None, []

    class _Tok:
        vocab, bos_id, eos_id = _Vocab(), None, None

    with pytest.raises(ChatTemplateError, match="m.gguf: the file has no tokenizer.chat_template"):
        ChatTemplate.from_tokenizer(_Tok())
