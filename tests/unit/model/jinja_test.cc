// The Jinja engine against Jinja2 as transformers configures it for apply_chat_template: each
// expected text below is what transformers' _compile_jinja_template(template).render(**context)
// gave (transformers 5.23, the reference venv) for the same template and context.
#include "tokenizer/jinja.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace shardserve {
namespace {

using json = nlohmann::ordered_json;
using ::testing::HasSubstr;

const json& Context() {
  static const json* c = new json(json::parse(
      R"J({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "  hi there  ", "name": "ann"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more?"}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}}}], "add_generation_prompt": true, "extra": {"x": 1, "y": "two"}, "bos_token": "<s>"})J"));
  return *c;
}

struct Case {
  const char* name;
  const char* tmpl;
  const char* want;
};

const Case kCases[] = {
    // Jinja2's iterable test (vLLM's Hermes template guards its tools header with it): None is
    // not iterable, an undefined value is.
    {"iterable",
     R"J({{ none is iterable }} {{ nothing is iterable }} {{ messages is iterable }} {{ 'ab' is iterable }} {{ 3 is iterable }} {{ extra is iterable }})J",
     "False True True True False True"},
    // A template written with CRLF line endings renders as Jinja2 reads it: "\n".
    {"crlf", "{% for m in messages %}\r\n<{{ m.role }}>\r\n{% endfor %}\r\nend\r\n",
     "<system>\n<user>\n<assistant>\n<user>\nend"},
    // tojson's ensure_ascii (Qwen3.5 templates people edit pass it): past ASCII as \uXXXX,
    // beyond the BMP as a surrogate pair.
    {"ensure_ascii",
     R"J({{ {'é': 'Wetter für 😀'} | tojson(ensure_ascii=true) }}|{{ 'für' | tojson(ensure_ascii=false) }}|{{ tools[0].function.description | tojson(ensure_ascii=true) }})J",
     R"J({"\u00e9": "Wetter f\u00fcr \ud83d\ude00"}|"für"|"Wetter f\u00fcr eine Stadt")J"},
    // transformers' {% generation %} block (TRL's templates mark the assistant's turns with it)
    // renders its body; its whitespace control stays.
    {"generation",
     "{% for m in messages %}{% if m.role == 'assistant' %}{%- generation -%}\n [{{ m.content }}]"
     "{% endgeneration %}{% else %}<{{ m.role }}>{% endif %}{% endfor %}",
     "<system><user>[hello]<user>"},
    {"generation_edges", "{#-#}{%+ if true +%}a{%+ endif +%}{{ 'b' }}", "ab"},
    {"chatml",
     R"J({% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})J",
     R"J(<|im_start|>system
be brief<|im_end|>
<|im_start|>user
  hi there  <|im_end|>
<|im_start|>assistant
hello<|im_end|>
<|im_start|>user
more?<|im_end|>
<|im_start|>assistant
)J"},
    {"macros",
     R"J({%- macro turn(role, text) -%}
[{{ role | upper }}] {{ text | trim }}
{%- endmacro -%}
{%- set ns = namespace(sys='none', n=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.sys = m.content -%}{%- continue -%}{%- endif -%}
  {%- set ns.n = ns.n + 1 -%}
  {{ turn(m.role, m.content) }}{{ ' | ' if not loop.last else '' }}
  {%- if ns.n >= 3 %}{% break %}{% endif -%}
{%- endfor %}
system={{ ns.sys }} turns={{ ns.n }} count={{ messages | length }} {{ messages | map(attribute='role') | join(',') }} {{ missing | default('dflt') }})J",
     R"J([USER] hi there | [ASSISTANT] hello | [USER] more?system=be brief turns=3 count=4 system,user,assistant,user dflt)J"},
    {"tools",
     R"J({% if tools %}{% for t in tools %}{{ t | tojson }}
{{ t.function | tojson(indent=4) }}
{% endfor %}{% endif %}{{ {'b': 1.5, 'a': [1, 0.0001, 1e-05, 12345678901234567890.0, none, true, 'é"\n'] } | tojson }}|{{ {'z': 1, 'a': 2} | tojson(sort_keys=true) }}|{{ [1,2] | tojson(separators=(',', ':')) }})J",
     R"J({"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}}}
{
    "name": "get_weather",
    "description": "Wetter für eine Stadt",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {
                "type": "string"
            },
            "days": {
                "type": "integer",
                "minimum": 1
            }
        },
        "required": [
            "city"
        ]
    }
}
{"b": 1.5, "a": [1, 0.0001, 1e-05, 1.2345678901234567e+19, null, true, "é\"\n"]}|{"a": 2, "z": 1}|[1,2])J"},
    {"pymethods",
     R"J({% for m in messages %}{{ m.content.strip() }}/{{ m.content.split(' ')[0] }}/{{ m.content.startswith('  hi') }}/{{ m['role'].upper() }}/{{ m.get('name', 'anon') }};{% endfor %}{% for k, v in extra.items() %}{{ k }}={{ v }},{% endfor %})J",
     R"J(be brief/be/False/SYSTEM/anon;hi there//True/USER/ann;hello/hello/False/ASSISTANT/anon;more?/more?/False/USER/anon;x=1,y=two,)J"},
    {"whitespace",
     R"J(<s>
{% for m in messages %}
    {% if m.role == 'user' %}
[INST] {{ m.content }} [/INST]
    {% else %}
{{ m.content }}</s>
    {% endif %}
{% endfor %}
)J",
     R"J(<s>
be brief</s>
[INST]   hi there   [/INST]
hello</s>
[INST] more? [/INST]
)J"},
};

// Loops, macros, namespaces, loop controls, filters, trim_blocks / lstrip_blocks, Python's string
// and dict methods, Python's True / False, and tojson as json.dumps (separators, indent, floats,
// unicode unescaped, sort_keys).
TEST(JinjaTest, RendersAsTransformersJinja2Does) {
  for (const Case& c : kCases) {
    auto got = RenderJinja(c.tmpl, Context());
    ASSERT_TRUE(got.ok()) << c.name << ": " << got.status();
    EXPECT_EQ(*got, c.want) << c.name;
  }
}

// raise_exception's message, a syntax error and a template that would run for ever come back as
// errors that say what happened; no input aborts the process.
TEST(JinjaTest, ErrorsComeBackAsText) {
  json ctx = Context();
  ctx["messages"].erase(ctx["messages"].begin());
  auto raised = RenderJinja(
      R"J({% for m in messages %}{% if m.role == 'user' and loop.index0 == 0 %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% endfor %})J",
      ctx);
  ASSERT_FALSE(raised.ok());
  EXPECT_THAT(std::string(raised.status().message()),
              HasSubstr("Conversation roles must alternate user/assistant/user/assistant/..."));
  auto syntax = RenderJinja("{% for m in messages %}{{ m.content }", Context());
  ASSERT_FALSE(syntax.ok());
  EXPECT_THAT(std::string(syntax.status().message()), HasSubstr("the chat template: "));
  auto endless = RenderJinja(
      "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
      Context());
  ASSERT_FALSE(endless.ok());
  EXPECT_THAT(std::string(endless.status().message()), HasSubstr("fuel"));
  EXPECT_FALSE(RenderJinja("{{ x }}", json::array()).ok());
  for (const char* tag : {"{%-%}", "{%--%}", "{%+-%}", "{%-", "{% endgeneration %}"}) {
    auto bad = RenderJinja(tag, Context());
    ASSERT_FALSE(bad.ok()) << tag;
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr("the chat template: ")) << tag;
  }
}

TEST(JinjaTest, StrftimeNowFormatsTheDate) {
  auto got = RenderJinja("{{ strftime_now('%Y') }}", Context());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->size(), 4u);
}

}  // namespace
}  // namespace shardserve
