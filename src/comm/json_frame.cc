#include "comm/json_frame.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {

using json = nlohmann::json;

std::string EncodeJsonFrame(const json& message) {
  const std::string body = message.dump();
  const uint32_t len = static_cast<uint32_t>(body.size());
  std::string frame(4, '\0');
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return frame + body;
}

absl::Status WriteJsonFrame(const WriteAll& write, const std::string& frame) {
  RETURN_IF_ERROR(write(frame.data(), 4));
  return write(frame.data() + 4, frame.size() - 4);
}

absl::StatusOr<json> ReadJsonFrame(const ReadExactly& read, uint32_t max_bytes, const char* what) {
  unsigned char header[4];
  RETURN_IF_ERROR(read(header, sizeof(header)));
  const uint32_t len =
      header[0] | header[1] << 8 | header[2] << 16 | static_cast<uint32_t>(header[3]) << 24;
  if (len > max_bytes) {
    return absl::DataLossError(absl::StrCat(what, " of ", len, " bytes (at most ", max_bytes, ")"));
  }
  std::string body(len, '\0');
  RETURN_IF_ERROR(read(body.data(), len));
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(absl::StrCat(what, " is not a JSON object"));
  }
  return j;
}

namespace {

absl::Status Bad(const char* key, const char* want) {
  return absl::DataLossError(absl::StrCat("'", key, "' is missing or not ", want));
}

}  // namespace

absl::StatusOr<int64_t> JsonInt(const json& m, const char* key, int64_t min, int64_t max) {
  auto it = m.find(key);
  if (it == m.end() || !it->is_number_integer()) return Bad(key, "an integer");
  // An unsigned value beyond int64 reads as negative here and is refused by the bounds.
  const int64_t v =
      it->is_number_unsigned() && it->get<uint64_t>() > INT64_MAX ? INT64_MIN : it->get<int64_t>();
  if (v < min || v > max) {
    return absl::DataLossError(
        absl::StrCat("'", key, "' is ", it->dump(), ", outside [", min, ", ", max, "]"));
  }
  return v;
}

absl::StatusOr<std::string> JsonString(const json& m, const char* key, size_t max_bytes) {
  auto it = m.find(key);
  if (it == m.end() || !it->is_string()) return Bad(key, "a string");
  const std::string& s = it->get_ref<const std::string&>();
  if (s.size() > max_bytes) {
    return absl::DataLossError(absl::StrCat("'", key, "' is longer than ", max_bytes, " bytes"));
  }
  return s;
}

absl::StatusOr<bool> JsonBool(const json& m, const char* key) {
  auto it = m.find(key);
  if (it == m.end() || !it->is_boolean()) return Bad(key, "a boolean");
  return it->get<bool>();
}

absl::StatusOr<double> JsonNumber(const json& m, const char* key) {
  auto it = m.find(key);
  if (it == m.end() || !it->is_number()) return Bad(key, "a number");
  return it->get<double>();
}

absl::StatusOr<const json*> JsonArray(const json& m, const char* key) {
  auto it = m.find(key);
  if (it == m.end() || !it->is_array()) return Bad(key, "an array");
  return &*it;
}

absl::StatusOr<std::vector<int64_t>> JsonInts(const json& m, const char* key, int64_t min,
                                              int64_t max) {
  ASSIGN_OR_RETURN(const json* array, JsonArray(m, key));
  std::vector<int64_t> out;
  out.reserve(array->size());
  for (const json& v : *array) {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(max)) ||
        v.get<int64_t>() < min || v.get<int64_t>() > max) {
      return absl::DataLossError(absl::StrCat("'", key, "' holds ", v.dump(),
                                              ", not an integer in [", min, ", ", max, "]"));
    }
    out.push_back(v.get<int64_t>());
  }
  return out;
}

}  // namespace shardserve
