#pragma once
// Jinja templates rendered as Hugging Face's apply_chat_template renders them, by minijinja
// (tokenizer/jinja: a Rust crate of ours behind a two-function C interface, built by CMake with
// cargo): trim_blocks and lstrip_blocks, loop controls, Python's string and dict methods,
// raise_exception, strftime_now, and a tojson that writes what Python's
// json.dumps(ensure_ascii=False) writes. A template is input from a model file: an error in it
// or raised by it is InvalidArgument quoting the engine's message, and its work is bounded.
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace shardserve {

// `context` (an object) gives the template's variables, its keys in their order (tojson keeps it).
absl::StatusOr<std::string> RenderJinja(std::string_view tmpl,
                                        const nlohmann::ordered_json& context);

}  // namespace shardserve
