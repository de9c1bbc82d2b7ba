// POST /tokenize and /detokenize, as vLLM serves them.
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "serve/api_server_impl.h"

namespace shardserve {

using api_internal::json;
using api_internal::ojson;

// POST /tokenize and /detokenize as vLLM serves them: a prompt (with add_special_tokens,
// default true) or chat messages and tools (rendered as for /v1/chat/completions, with its chat
// options: add_generation_prompt, continue_final_message, chat_template_kwargs, documents,
// chat_template) to {"count", "max_model_len", "tokens"}; token ids to {"prompt"}.
// `model` may be left out.
http::Response ApiServer::Impl::Tokenization(const http::Request& http_req, bool detokenize) {
  if (auto denied = Deny(http_req)) return *std::move(denied);
  absl::StatusOr<ojson> body = Body(http_req);
  if (!body.ok()) return Reply(body.status());
  absl::StatusOr<json> out = [&]() -> absl::StatusOr<json> {
    if (!body->is_object()) return BadParam("", "the request body must be a JSON object");
    if (auto m = body->find("model"); m != body->end() && !m->is_null()) {
      if (!m->is_string()) return BadParam("model", "'model' must be a string");
      RETURN_IF_ERROR(Served(m->get<std::string>()).status());
    }
    int64_t context, vocab;
    {
      absl::ReaderMutexLock lock(&engine_mu);
      if (engine == nullptr) return absl::UnavailableError(not_ready);
      context = max_context;
      vocab = vocab_size;
    }
    if (detokenize) {
      auto t = body->find("tokens");
      if (t == body->end() || !t->is_array() || t->size() > static_cast<size_t>(context)) {
        return BadParam("tokens",
                        absl::StrCat("'tokens' must be a list of at most ", context, " token ids"));
      }
      std::vector<int32_t> ids;
      for (const ojson& id : *t) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab) {
          return BadParam("tokens",
                          absl::StrCat("'tokens' entries must be token ids in [0, ", vocab, ")"));
        }
        ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
      return json{{"prompt", tokenizer->Decode(ids)}};
    }
    std::vector<int32_t> ids;
    bool add_special = !body->contains("messages");  // vLLM's defaults: prompt true, chat false
    if (auto a = body->find("add_special_tokens"); a != body->end() && !a->is_null()) {
      if (!a->is_boolean()) {
        return BadParam("add_special_tokens", "'add_special_tokens' must be a boolean");
      }
      add_special = a->get<bool>();
    }
    if (body->contains("messages")) {
      ojson chat_body = *body;
      chat_body["model"] = config.env.model_name;
      ASSIGN_OR_RETURN(ApiRequest req, ParseApiRequest(chat_body, true));
      RETURN_IF_ERROR(ToolsRunHere(req));
      ASSIGN_OR_RETURN(ids, prompt_builder->Chat(req, context, add_special));
    } else {
      auto p = body->find("prompt");
      if (p == body->end() || !p->is_string()) {
        return BadParam("prompt", "'prompt' must be a string (or give 'messages')");
      }
      ASSIGN_OR_RETURN(
          ids, prompt_builder->Tokenize(p->get<std::string>(), add_special, context, "prompt"));
    }
    return json{{"count", ids.size()}, {"max_model_len", context}, {"tokens", ids}};
  }();
  if (!out.ok()) return Reply(out.status());
  return Json(*out);
}

}  // namespace shardserve
