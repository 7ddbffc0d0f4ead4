"""The chat template's bounds (ellm/runtime/chat_template.py): real templates render exactly as jinja2's own
sandbox renders them, and each way a template from a hostile GGUF could hang or exhaust memory is one line."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ellm.errors import GGUFError
from ellm.runtime import chat_template as ct
from ellm.runtime.chat_template import ChatTemplate

# Written in the manner of current tool-calling templates: namespace state, macros, loops, tests, filters,
# `~`, `+`, `%`, string methods, loop.last, a raise.
REALISTIC = """
{%- macro block(role, text) -%}<|im_start|>{{ role }}\n{{ text | trim }}<|im_end|>\n{% endmacro -%}
{%- set ns = namespace(system='', last_user=-1, names=[]) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endif -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools is defined and tools -%}
  {%- for t in tools -%}{%- set ns.names = ns.names + [t.name] -%}{%- endfor -%}
  {{- block('system', ns.system ~ '\n# Tools: ' ~ ns.names | join(', ') ~ '\n' ~ tools | tojson) -}}
{%- elif ns.system -%}{{- block('system', ns.system) -}}
{%- else -%}{{- block('system', 'You are a helpful assistant (%s).' % 'default') -}}
{%- endif -%}
{%- for m in messages if m.role != 'system' -%}
  {%- if m.role not in ['user', 'assistant'] -%}{{ raise_exception('unknown role ' ~ m.role) }}{%- endif -%}
  {%- set text = m.content.split('</think>')[-1] if m.role == 'assistant' and loop.index0 < ns.last_user
                 else m.content -%}
  {{- block(m.role, text) -}}
  {%- if loop.last and m.role == 'assistant' and m.content.startswith('<think>') -%}{{ '-' * 3 }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>easy</think>4"}, {"role": "user", "content": "  and 3+3?  "}],
    [{"role": "user", "content": "ünïcödé ✓ " * 200}, {"role": "assistant", "content": "<think>x"}],
]


def _render(**v):
    return ChatTemplate(REALISTIC).render(**v)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, [{"name": "search", "parameters": {"q": "string"}}, {"name": "calc"}]])
def test_a_realistic_template_renders_as_jinja2_renders_it(messages, tools):
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    v = dict(messages=messages, add_generation_prompt=True, **({"tools": tools} if tools else {}))
    expected = plain.from_string(REALISTIC).render(**v)
    assert _render(**v) == expected and "<|im_start|>assistant" in expected


def test_what_hugging_faces_renderer_offers_templates():
    # {% break %} (Command R7B), {% generation %} (assistant masks), tojson without HTML escapes (tool schemas)
    tpl = ("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}"
           "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ tools | tojson }}")
    text = ChatTemplate(tpl).render(messages=[{"content": c} for c in "abc"], tools={"q": "<é> & 'x'"})
    assert text == """[a][b]{"q": "<é> & 'x'"}"""
    assert len(ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render(messages=[])) == 10


def test_the_templates_own_error_is_one_line():
    with pytest.raises(GGUFError, match="chat template failed: unknown role tool"):
        _render(messages=[{"role": "tool", "content": "x"}], add_generation_prompt=True)


def _refused(template: str, match: str, content: str = "hi", seconds: float = 1.0):
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match=match) as e:
        ChatTemplate(template).render(messages=[{"role": "user", "content": content}], add_generation_prompt=True)
    assert time.perf_counter() - t0 < seconds and "\n" not in str(e.value)
    assert sys.gettrace() is None  # the deadline's tracer is gone


@pytest.mark.parametrize("template,match", [
    ("{{ 9 ** 999999999 }}", "has more than 4096 bits"),  # jinja2: ** is left-associative
    ("{{ 'x' * 10 ** 12 }}", "would build a value of 1,000,000,000,000 items"),
    ("{{ [0] * 5000000 }}", "value of 5,000,000 items"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "~ would"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", r"\+ would"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s %}{{ ns.s }}{{ ns.s }}{% endset %}"
     "{% endfor %}", "a block would"),
    ("{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='ab') %}"
     "{% for i in range(60) %}{% set ns.s = twice(ns.s) %}{% endfor %}", "a block would"),
    ("{{ lipsum(1000000) }}", "'lipsum' is undefined"),
    ("{{ '%1000000000d' % 1 }}", "width of a million or more"),
    ("{{ '{:>1000000000}'.format(1) }}", "width of a million or more"),
    ("{{ '%1000000000s' | format('a') }}", "the filter format with a width of a million or more"),
    ("{{ 'a' | center(10 ** 9) }}", "the filter center called with 1000000000"),
    ("{{ 'a'.ljust(10 ** 9) }}", "ljust called with 1000000000"),
    ("{{ messages[0].content.replace('', messages[0].content) }}", "replace would"),
    ("{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}", "the rendered conversation would"),
    # found by the atheris run (fuzz/RUNS.md): jinja2's code generator took 5 s on this (13 s instrumented)
    ("{% if l" + "+" * 290 + "oop.first %}x{% endif %}", "expressions nested 29[0-9] deep"),
    ("x" * 70000, "chat template is 70,000 characters"),
])
def test_each_bound_is_one_line_and_quick(template, match):
    _refused(template, match, content="y" * 3000)


def test_a_loop_that_builds_nothing_meets_the_deadline():
    _refused("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
             "rendering the chat template took longer than 2 s", seconds=ct.SECONDS + 1.5)


def test_values_scale_with_the_conversation():
    # A long conversation may be repeated in a system preamble without meeting the 4M-item floor's limit.
    long = "z" * 3_000_000
    text = ChatTemplate("{{ messages[0].content * 2 }}").render(messages=[{"role": "user", "content": long}])
    assert len(text) == 6_000_000


def test_renders_from_several_threads():
    tpl, results = ChatTemplate(REALISTIC), {}

    def one(i):
        results[i] = tpl.render(messages=CONVERSATIONS[i % 3], add_generation_prompt=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(6)] == [tpl.render(messages=CONVERSATIONS[i % 3], add_generation_prompt=True)
                                              for i in range(6)]
