#include "tokenizer/jinja.h"

#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"

extern "C" {
int ss_jinja_render(const uint8_t* tmpl, size_t tmpl_len, const uint8_t* context,
                    size_t context_len, uint8_t** out, size_t* out_len);
void ss_jinja_free(uint8_t* p, size_t len);
}

namespace shardserve {

absl::StatusOr<std::string> RenderJinja(std::string_view tmpl,
                                        const nlohmann::ordered_json& context) {
  if (!context.is_object()) {
    return absl::InvalidArgumentError("a chat template's variables must be a JSON object");
  }
  const std::string ctx =
      context.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  uint8_t* out = nullptr;
  size_t len = 0;
  const int rc =
      ss_jinja_render(reinterpret_cast<const uint8_t*>(tmpl.data()), tmpl.size(),
                      reinterpret_cast<const uint8_t*>(ctx.data()), ctx.size(), &out, &len);
  std::string text(reinterpret_cast<const char*>(out), len);
  ss_jinja_free(out, len);
  if (rc != 0) return absl::InvalidArgumentError(absl::StrCat("the chat template: ", text));
  return text;
}

}  // namespace shardserve
