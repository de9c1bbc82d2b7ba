// Request parsing (pure) and the text stream's stop-string handling.
#include "serve/openai.h"

#include <gtest/gtest.h>

#include "devtools/bpe_trainer.h"
#include "devtools/corpus.h"
#include "serve/text_stream.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

using json = nlohmann::json;

TEST(OpenAiParse, AcceptsTheOpenAiShapes) {
  auto r = ParseApiRequest(json::parse(R"({"model": "m", "prompt": [[1, 2], "hi"],
      "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "x",
      "logprobs": 2, "stream": true, "stream_options": {"include_usage": true}, "user": "u"})"),
                           false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt_ids[0], (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r->prompt_texts[1], "hi");
  EXPECT_EQ(r->params.max_tokens, 5);
  EXPECT_FLOAT_EQ(r->params.temperature, 0.5f);
  EXPECT_EQ(r->params.top_logprobs, 2);
  EXPECT_TRUE(r->logprobs && r->stream && r->include_usage && r->seed_set);
  EXPECT_EQ(r->stop, std::vector<std::string>{"x"});

  auto c = ParseApiRequest(json::parse(R"({"model": "m", "messages": [
      {"role": "developer", "content": "s"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 3})"),
                           true);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->messages[0].role, "system");
  EXPECT_EQ(c->messages[1].content, "ab");
  EXPECT_EQ(c->params.max_tokens, 7);
  EXPECT_EQ(c->params.top_logprobs, 3);
  EXPECT_FLOAT_EQ(c->params.temperature, 1.0f);  // OpenAI's default
}

TEST(OpenAiParse, RefusalsNameTheParameter) {
  struct Case {
    const char* body;
    bool chat;
    const char* param;
  };
  const Case cases[] = {
      {R"({"prompt": "x"})", false, "model"},
      {R"({"model": "m"})", false, "prompt"},
      {R"({"model": "m", "prompt": []})", false, "prompt"},
      {R"({"model": "m", "prompt": [1, -2]})", false, "prompt"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 0})", false, "max_tokens"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 2.5})", false, "max_tokens"},
      {R"({"model": "m", "prompt": "x", "temperature": "hot"})", false, "temperature"},
      {R"({"model": "m", "prompt": "x", "top_p": 0})", false, "top_p"},
      {R"({"model": "m", "prompt": "x", "n": 3})", false, "n"},
      {R"({"model": "m", "prompt": "x", "echo": true})", false, "echo"},
      {R"({"model": "m", "prompt": "x", "stop": ["a", 1]})", false, "stop"},
      {R"({"model": "m", "prompt": "x", "logprobs": 50})", false, "logprobs"},
      {R"({"model": "m", "prompt": "x", "stream_options": {}})", false, "stream_options"},
      {R"({"model": "m", "prompt": "x", "frequency_penalty": 1})", false, "frequency_penalty"},
      {R"({"model": "m", "messages": []})", true, "messages"},
      {R"({"model": "m", "messages": [{"role": "user"}]})", true, "messages[0].content"},
      {R"({"model": "m", "messages": [{"role": "bot", "content": "x"}]})", true,
       "messages[0].role"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", true,
       "top_logprobs"},
  };
  for (const Case& c : cases) {
    auto r = ParseApiRequest(json::parse(c.body), c.chat);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_EQ(ErrorParam(r.status()), c.param) << c.body << ": " << r.status();
    const json body = ErrorBody(r.status());
    EXPECT_EQ(body["error"]["param"], c.param);
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  }
}

TEST(TextStream, HoldsBackAPossibleStopStringAndCutsBeforeIt) {
  auto trained = TrainBpeTokenizer(DefaultCorpus(), TokenizerStyle::kByteLevel, 300);
  auto tok = Tokenizer::FromJson(trained->json, "test");
  ASSERT_TRUE(tok.ok());
  const std::string text = "the cat sat on the mat. END of story";
  auto ids = *(*tok)->Encode(text, false);
  TextStream stream(tok->get(), {"END"});
  std::string out;
  bool stopped = false;
  for (int32_t id : ids) {
    auto d = stream.Add({id});
    EXPECT_EQ(d.token_texts.size(), 1u);
    out += d.text;
    // Never more than what precedes the stop string.
    EXPECT_LE(out.size(), text.find("END"));
    if (d.stopped) {
      stopped = true;
      break;
    }
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(out, "the cat sat on the mat. ");

  TextStream plain(tok->get(), {"zzz"});
  std::string all;
  for (int32_t id : ids) all += plain.Add({id}).text;
  all += plain.Flush();
  EXPECT_EQ(all, text);
}

}  // namespace
}  // namespace shardserve
