#!/usr/bin/env python3
"""Renders every chat template in tests/data/chat_templates/ over a fixed set of conversations with
Python's jinja2, configured the way Hugging Face's apply_chat_template configures it
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols; tojson = json.dumps with
ensure_ascii=False; raise_exception and strftime_now globals), and writes the results to
tests/data/chat_templates/expected.json. The C++ test (src/template/chat_template_test.cc) renders
the same cases with dl::ChatTemplate and asserts byte equality.

  python3 tools/reference/render_chat_templates.py            # rewrite the committed fixture
  python3 tools/reference/render_chat_templates.py --check FILE --out OUT
      # render into OUT and compare with FILE (CTest does this); exit 77 when jinja2 is missing
"""
import argparse
import copy
import json
import os
import sys
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE_DIR = os.path.join(ROOT, "tests", "data", "chat_templates")
DEFAULT_OUT = os.path.join(TEMPLATE_DIR, "expected.json")


def make_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# ---------------------------------------------------------------- conversations

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.\nUses live data & returns <json>.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 'Paris'"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_code",
        "description": "Search the repository.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "paths": {"type": "array", "items": {"type": "string"}},
                "max_results": {"type": "number"},
                "options": {"type": "object"},
            },
            "required": ["query", "paths"],
        },
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one sentence."}

CONVERSATIONS = {
    "system_user": [SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
    "user_only": [{"role": "user", "content": "Hello!"}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "  I am an assistant.  "},
        {"role": "user", "content": "Tell me a joke.\n"},
    ],
    "multi_turn_ending_assistant": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two, three."},
    ],
    "tool_calls": [
        SYSTEM,
        {"role": "user", "content": "Weather in Paris and search for 'parse_config'?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I need two tools.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}},
                {"type": "function", "function": {"name": "search_code", "arguments": {
                    "query": "parse_config <T> & 'x'", "paths": ["src/", "tests/"],
                    "max_results": 2.5, "options": {"regex": False, "case": None, "depth": -1},
                    "note": "naïve café ☕"}}},
            ],
        },
        {"role": "tool", "content": "{\"temp_c\": 18, \"sky\": \"cloudy\"}"},
        {"role": "tool", "content": "src/config.cc:12: Status parse_config()"},
        {"role": "assistant", "content": "It is 18 °C and cloudy; parse_config is in src/config.cc.",
         "reasoning_content": "Both tools answered."},
        {"role": "user", "content": "Thanks."},
    ],
    "single_tool_call": [
        {"role": "user", "content": "Weather in Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "東京", "days": 1}}}]},
        {"role": "tool", "content": "sunny"},
    ],
    "thinking_history": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "  Simple arithmetic: 2+2=4.\n"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "3+3=6."},
    ],
    "unicode": [
        {"role": "system", "content": "Réponds en français — avec des emojis 🎉."},
        {"role": "user", "content": "Ünïcödé ✓ 日本語 \"quotes\" 'single' <tag> & \\backslash\\\ttab\nnewline 〈|EOS|〉"},
    ],
    "empty_content": [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "   "},
    ],
    "content_parts": [
        {"role": "user", "content": [{"type": "text", "text": "Part one. "},
                                     {"type": "text", "text": "Part two."}]},
    ],
    "bad_role": [
        {"role": "user", "content": "hi"},
        {"role": "narrator", "content": "Once upon a time"},
    ],
    "not_alternating": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ],
}

BASE = {"bos_token": "<s>", "eos_token": "</s>"}

# (case name, conversation, tools, extra kwargs)
VARIANTS = [
    ("system_user", "system_user", None, {"add_generation_prompt": True}),
    ("system_user_no_prompt", "system_user", None, {"add_generation_prompt": False}),
    ("user_only", "user_only", None, {"add_generation_prompt": True}),
    ("multi_turn", "multi_turn", None, {"add_generation_prompt": True}),
    ("multi_turn_ending_assistant", "multi_turn_ending_assistant", None,
     {"add_generation_prompt": False}),
    ("tools_no_calls", "user_only", TOOLS, {"add_generation_prompt": True}),
    ("tool_calls", "tool_calls", TOOLS, {"add_generation_prompt": True}),
    ("tool_calls_thinking_off", "tool_calls", TOOLS,
     {"add_generation_prompt": True, "enable_thinking": False}),
    ("single_tool_call", "single_tool_call", [WEATHER_TOOL], {"add_generation_prompt": True}),
    ("thinking_default", "thinking_history", None, {"add_generation_prompt": True}),
    ("thinking_off", "thinking_history", None,
     {"add_generation_prompt": True, "enable_thinking": False}),
    ("thinking_preserved", "thinking_history", None,
     {"add_generation_prompt": True, "enable_thinking": True, "preserve_thinking": True}),
    ("unicode", "unicode", None, {"add_generation_prompt": True}),
    ("empty_content", "empty_content", None, {"add_generation_prompt": True}),
    ("content_parts", "content_parts", None, {"add_generation_prompt": False}),
    ("bad_role", "bad_role", None, {"add_generation_prompt": True}),
    ("not_alternating", "not_alternating", None, {"add_generation_prompt": True}),
    ("llama_tools_in_system", "single_tool_call", [WEATHER_TOOL],
     {"add_generation_prompt": True, "tools_in_user_message": False, "date_string": "01 Jan 2026"}),
]



# Small templates exercising one feature each (expressions, filters, tests, statements, whitespace
# control); rendered by jinja2 like the chat templates, asserted byte-equal by the C++ test.
SNIPPET_CONTEXT = {
    "s": "  Hello, World  ", "n": 7, "f": 2.5, "neg": -3, "t": True, "none": None, "empty": "",
    "items": [3, 1, 2], "words": ["b", "A", "c", "a"], "d": {"b": 1, "a": 2, "c": None},
    "users": [{"name": "ann", "age": 31, "role": "admin"}, {"name": "bob", "age": 25},
              {"name": "cy", "age": 40, "role": "user"}],
    "uni": "héllo wörld ☕", "nested": {"x": {"y": [10, {"z": "deep"}]}},
    "msg": {"role": "user", "content": "hi", "tool_calls": []},
}
SNIPPETS = [
    ("literals", "{{ 1 }}|{{ -2 }}|{{ 1.5 }}|{{ 1e3 }}|{{ 1_000 }}|{{ 'a' 'b' }}|{{ \"q\\\"\" }}|{{ true }}|{{ False }}|{{ none }}|{{ None }}"),
    ("string_escapes", "{{ 'tab\\there\\nnl \\\\ \\u00e9 \\x41' }}"),
    ("containers", "{{ [1, 'a', none, true, 1.0] }}|{{ {'k': 'v', 'n': [1]} }}|{{ (1, 2) }}|{{ (1,) }}|{{ () }}"),
    ("python_str_repr", "{{ [\"it's\", 'say \"hi\"', 'both \\' \"', 'nl\\n'] }}"),
    ("arithmetic", "{{ 7 + 3 }} {{ 7 - 10 }} {{ 7 * 3 }} {{ 7 / 2 }} {{ 8 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 1.5 + 1 }} {{ true + 1 }}"),
    ("float_repr", "{{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 3.0 }} {{ -0.0 }} {{ 123456789.125 }} {{ 1 / 3 }}"),
    ("concat", "{{ 'a' ~ 1 ~ none ~ true ~ undefined_var ~ [1] }}|{{ 'x' + 'y' }}|{{ [1] + [2, 3] }}|{{ 'ab' * 3 }}"),
    ("precedence", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ not true or true }} {{ not (true or true) }} {{ (1 + 2) ~ 3 }} {{ 1 ~ 2 * 3 }} {{ 'ab' ~ 'c' | upper }}"),
    ("comparisons", "{{ 1 == 1.0 }} {{ 1 != 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 2 >= 2 }} {{ 1 <= 0 }} {{ true == 1 }} {{ none == none }} {{ 'a' == 'a' }} {{ {'a': 1} == {'a': 1} }}"),
    ("in_operator", "{{ 'ell' in 'hello' }} {{ 2 in items }} {{ 5 not in items }} {{ 'a' in d }} {{ 'z' in d }} {{ 'x' in undefined_var }}"),
    ("logic_values", "{{ 0 or 'x' }}|{{ 'a' and 'b' }}|{{ '' and 'b' }}|{{ none or [] }}|{{ items and items[0] }}"),
    ("cond_expr", "{{ 'yes' if t else 'no' }}|{{ 'yes' if none else 'no' }}|{{ 'only-if' if false }}|{{ 1 if n > 5 else 2 if n > 3 else 3 }}"),
    ("attr_item", "{{ msg.role }} {{ msg['content'] }} {{ nested.x.y[1].z }} {{ nested['x']['y'][0] }} {{ items[-1] }} {{ items.0 }} {{ msg.missing }}|{{ items[10] }}|{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 5) }}"),
    ("slices", "{{ items[1:] }} {{ items[:-1] }} {{ items[::-1] }} {{ items[::2] }} {{ 'abcdef'[1:4] }} {{ 'abcdef'[::-2] }} {{ uni[1:5] }} {{ uni[-1] }} {{ items[5:] }} {{ items[-10:2] }}"),
    ("undefined", "[{{ nope }}]{% for x in nope %}x{% endfor %}{{ nope | length }}{{ nope | default('dflt') }}{{ nope is defined }}{{ nope is undefined }}{{ msg.nope is defined }}{{ nope == nope }}{{ nope | list }}"),
    ("default_filter", "{{ none | default('x') }}|{{ none | d('x', true) }}|{{ '' | default('e', boolean=true) }}|{{ 0 | default(5) }}|{{ msg.nope | d(msg.role) }}"),
    ("string_filters", "{{ s | trim }}|{{ s | upper }}|{{ s | lower }}|{{ 'hello world-foo(bar) it\\'s' | title }}|{{ 'hELLO wORLD' | capitalize }}|{{ 'xxhixx' | trim('x') }}|{{ s | replace('l', 'L') }}|{{ 'aaa' | replace('a', 'b', 2) }}|{{ uni | length }}|{{ uni | upper }}"),
    ("list_filters", "{{ items | first }} {{ items | last }} {{ items | length }} {{ items | count }} {{ items | join('-') }} {{ items | sort }} {{ items | sort(reverse=true) }} {{ words | sort }} {{ words | sort(case_sensitive=true) }} {{ items | reverse | list }} {{ 'abc' | reverse }} {{ items | sum }} {{ items | min }} {{ items | max }} {{ [1, 1, 2] | unique | list }} {{ words | unique | list }}"),
    ("dict_filters", "{{ d | dictsort }}|{{ d | dictsort(reverse=true) }}|{{ d | items | list }}|{{ d.items() | list }}|{{ d.keys() | list }}|{{ d.values() | list }}|{{ d | list }}|{{ d | length }}|{{ d | first }}"),
    ("attr_filters", "{{ users | map(attribute='name') | join(',') }}|{{ users | selectattr('role') | map(attribute='name') | list }}|{{ users | rejectattr('role') | map(attribute='name') | list }}|{{ users | selectattr('role', 'equalto', 'admin') | map(attribute='name') | first }}|{{ users | selectattr('age', 'gt', 30) | list | length }}|{{ users | sort(attribute='age') | map(attribute='name') | join }}|{{ users | map(attribute='role', default='none') | list }}|{{ users | join(', ', attribute='name') }}"),
    ("select_map", "{{ items | select('odd') | list }} {{ items | reject('odd') | list }} {{ words | map('upper') | list }} {{ ['1', '2'] | map('int') | sum }} {{ [none, 1, '', 'a'] | select | list }}"),
    ("number_filters", "{{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ 3.9 | int }} {{ '2.5' | float }} {{ 'y' | float }} {{ -5 | abs }} {{ neg | abs }} {{ 2.567 | round(2) }} {{ 2.5 | round }} {{ 3.5 | round }} {{ 2.1 | round(0, 'ceil') }} {{ 7 | round }} {{ 5 | string ~ 'x' }} {{ f | string }}"),
    ("tojson", "{{ d | tojson }}|{{ users[0] | tojson(indent=2) }}|{{ 'é<>&\\'\"\\n' | tojson }}|{{ [1.0, 2.5, none, true] | tojson }}|{{ d | tojson(sort_keys=true) }}|{{ [] | tojson(indent=2) }}|{{ {'a': {}} | tojson(indent=1) }}|{{ uni | tojson(ensure_ascii=true) }}|{{ d | tojson(separators=(',', ':')) }}"),
    ("indent_filter", "{{ 'a\\nb\\n\\nc' | indent }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent(2, blank=true) }}|{{ 'x\\ny' | indent('> ') }}"),
    ("escape", "{{ '<a href=\"x\">&\\'</a>' | e }}|{{ '<b>' | escape }}|{{ '<b>' | safe }}"),
    ("tests", "{{ 1 is number }}{{ 1.5 is float }}{{ 1 is integer }}{{ true is boolean }}{{ true is number }}{{ 's' is string }}{{ d is mapping }}{{ items is sequence }}{{ items is iterable }}{{ 's' is iterable }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ none is none }}{{ 1 is not none }}{{ true is true }}{{ 0 is false }}{{ 2 is eq 2 }}{{ 'a' is in 'abc' }}{{ 'abc' is lower }}{{ range is callable }}{{ 3 is gt 2 }}{{ 1 is sameas 1 }}"),
    ("string_methods", "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a-b-c'.rsplit('-', 1) }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'Abc'.upper() }}{{ 'Abc'.lower() }}|{{ 'hello world'.title() }}|{{ 'x y'.replace(' ', '_') }}|{{ '{} and {name}'.format(1, name='n') }}|{{ ', '.join(['a', 'b']) }}|{{ 'hello'.find('l') }} {{ 'hello'.count('l') }}|{{ '--x--'.strip('-') }}|{{ '12'.isdigit() }}"),
    ("range_loop", "{% for i in range(3) %}{{ i }}{% endfor %}|{% for i in range(1, 10, 3) %}{{ i }},{% endfor %}|{% for i in range(5, 0, -2) %}{{ i }}{% endfor %}"),
    ("loop_vars", "{% for x in ['a', 'b', 'c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem | default('-') }}{{ loop.nextitem | default('-') }}{{ loop.cycle('o', 'e') }};{% endfor %}"),
    ("loop_filter_else", "{% for x in items if x > 1 %}{{ x }}{{ loop.length }}{{ loop.last }} {% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in items if x > 100 %}x{% else %}none{% endfor %}"),
    ("loop_unpack", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{% for k, v in d | dictsort %}{{ k }}{% endfor %}|{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}|{% for (k, v) in [('x', 1)] %}{{ k }}{{ v }}{% endfor %}|{% for c in 'héj' %}[{{ c }}]{% endfor %}|{% for k in d %}{{ k }}{% endfor %}"),
    ("nested_loops", "{% for a in [1, 2] %}{% for b in ['x', 'y'] %}{{ a }}{{ b }}{{ loop.index }}{% endfor %}{{ loop.index }} {% endfor %}"),
    ("break_continue", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
    ("set_scoping", "{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + 10 %}{{ x }} {% endfor %}{{ x }}{% if true %}{% set x = 5 %}{% endif %} {{ x }}"),
    ("namespace", "{% set ns = namespace(total=0, names=[], found=false) %}{% for u in users %}{% set ns.total = ns.total + u.age %}{% if u.role == 'user' %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.total }} {{ ns.found }}"),
    ("set_tuple_and_block", "{% set a, b = [1, 2] %}{{ a }}{{ b }}{% set c = 1, 2 %}{{ c }}{% set blk %}inside {{ a }}{% endset %}[{{ blk }}]{% set up | upper %}shout{% endset %}{{ up }}"),
    ("macros", "{% macro greet(name, greeting='Hello', punct='!') %}{{ greeting }}, {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', 'Hi') }} {{ greet('Cy', punct='?') }} {{ greet(name='Di', greeting='Yo') }}"),
    ("macro_recursion", "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1) | int }}{% endif %}{% endmacro %}{{ fact(5) }}"),
    ("call_block", "{% macro box(title) %}<{{ title }}>{{ caller() }}</{{ title }}>{% endmacro %}{% call box('t') %}body {{ n }}{% endcall %}|{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}{% call(v) each([1, 2]) %}[{{ v }}]{% endcall %}"),
    ("filter_block", "{% filter upper %}shout {{ 'it' }}{% endfilter %}|{% filter trim | replace('a', 'o') %}  banana  {% endfilter %}"),
    ("raw_and_comments", "a{# comment {{ x }} #}b{% raw %}{{ not rendered }} {% if %}{% endraw %}c"),
    ("whitespace_control", "a  {{- ' b ' -}}  c\n  {%- if true -%}  d  {%- endif -%}  \ne {{ 'f' }}\n{{ 'g' -}}\n\n  h"),
    ("trim_lstrip_blocks", "<ul>\n  {% for i in [1, 2] %}\n    <li>{{ i }}</li>\n  {% endfor %}\n</ul>\n  {# note #}\nend\n{% if true %}  kept-indent\n{% endif %}"),
    ("lstrip_plus_and_trim_plus", "x\n    {%+ if true %}y{% endif +%}\nz\n{% if true %}w{% endif %}  \n"),
    ("inline_block_after_text", "text {% if true %}a{% endif %}\n  {{ 'v' }} {% if true %}b\n{% endif %}\n"),
    ("dict_literal_in_output", "{{ {'a': {'b': 1}} }}{{ {'x': [1, {'y': 2}]}['x'][1]['y'] }}"),
    ("unicode_passthrough", "{{ uni }}|{{ uni | tojson }}|{{ '日本' ~ uni[0] }}|{{ '〈|EOS|〉' }}"),
    ("append_free_list_building", "{% set ns = namespace(out=[]) %}{% for u in users %}{% set ns.out = ns.out + [u.name | upper] %}{% endfor %}{{ ns.out | join(' ') }}"),
    ("format_filter", "{{ '%s-%d %%' | format('a', 3) }}"),
    ("strings_with_braces", "{{ '}}' }}{{ '{%' }}{{ \"%}\" }}"),
    ("tests_on_messages", "{% if msg.tool_calls is defined and msg.tool_calls | length == 0 %}empty-calls{% endif %}{% if msg.content is string and not msg.content.startswith('x') %} ok{% endif %}"),
    ("raise_in_snippet", "before{{ raise_exception('custom failure: ' ~ n) }}after"),
    ("error_undefined_attr", "{{ nope.attr }}"),
    ("error_undefined_chain", "{{ msg.missing.deeper }}"),
    ("error_add_str_int", "{{ 'a' + 1 }}"),
    ("error_div_zero", "{{ 1 / 0 }}"),
    ("error_namespace_attr_on_dict", "{% set d.x = 1 %}"),
]


def render_all():
    import jinja2

    env = make_env()
    names = sorted(f for f in os.listdir(TEMPLATE_DIR) if f.endswith(".jinja"))
    cases = []
    for name in names:
        with open(os.path.join(TEMPLATE_DIR, name), encoding="utf-8") as f:
            template = env.from_string(f.read())
        for case, conv, tools, kwargs in VARIANTS:
            context = dict(BASE)
            context["messages"] = copy.deepcopy(CONVERSATIONS[conv])
            if tools is not None:
                context["tools"] = copy.deepcopy(tools)
            context.update(kwargs)
            entry = {"template": name, "case": case, "context": context}
            try:
                entry["expected"] = template.render(**copy.deepcopy(context))
            except jinja2.exceptions.TemplateError as e:
                # raise_exception() and jinja2's own errors; the C++ side must fail too, and for
                # raise_exception keep the message verbatim.
                entry["error"] = str(e)
                entry["error_type"] = type(e).__name__
            except Exception as e:  # noqa: BLE001 - Python errors inside the template
                entry["error"] = str(e)
                entry["error_type"] = type(e).__name__
            cases.append(entry)
    snippets = []
    for name, source in SNIPPETS:
        entry = {"name": name, "source": source}
        try:
            entry["expected"] = env.from_string(source).render(**copy.deepcopy(SNIPPET_CONTEXT))
        except Exception as e:  # noqa: BLE001
            entry["error"] = str(e)
            entry["error_type"] = type(e).__name__
        snippets.append(entry)
    return {
        "generator": "tools/reference/render_chat_templates.py",
        "snippet_context": SNIPPET_CONTEXT,
        "snippets": snippets,
        "jinja2_version": jinja2.__version__,
        "cases": cases,
    }


def dump(doc):
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="where to write the rendered cases")
    ap.add_argument("--check", metavar="FILE",
                    help="compare the rendering with FILE (ignoring jinja2_version); exit 1 on drift")
    args = ap.parse_args()
    try:
        import jinja2  # noqa: F401
    except ImportError:
        print("SKIPPED: python3 has no jinja2 module (Debian: python3-jinja2); fixture not checked")
        return 77
    doc = render_all()
    text = dump(doc)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {len(doc['cases'])} cases to {args.out} (jinja2 {doc['jinja2_version']})")
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            committed = json.load(f)
        fresh = json.loads(text)
        committed.pop("jinja2_version", None)
        fresh.pop("jinja2_version", None)
        if committed != fresh:
            old = {(c["template"], c["case"]): c for c in committed.get("cases", [])}
            new = {(c["template"], c["case"]): c for c in fresh["cases"]}
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    print(f"DRIFT: {key[0]} / {key[1]}")
            print(f"FAILED: {args.check} is stale; regenerate it with "
                  f"python3 tools/reference/render_chat_templates.py")
            return 1
        print(f"OK: {args.check} matches jinja2's rendering")
    return 0


if __name__ == "__main__":
    sys.exit(main())
