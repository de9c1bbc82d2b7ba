#include "api/adapters.h"

#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace shardserve {

absl::Status CheckAdapterName(const std::string& name) {
  const bool chars_ok = std::all_of(name.begin(), name.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
           c == '/' || c == ':';
  });
  const bool dots = name.find_first_not_of('.') == std::string_view::npos;
  if (name.empty() || name.size() > 128 || !chars_ok || dots) {
    return absl::InvalidArgumentError(
        absl::StrCat("the adapter name '", name.substr(0, 200),
                     "' must be 1 to 128 letters, digits or . _ - / : (not only dots)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<AdapterRef>> ParseAdapterList(std::string_view text) {
  std::vector<AdapterRef> out;
  if (text.empty()) return out;
  constexpr char kVar[] = "SHARDSERVE_LORA_ADAPTERS";
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kVar, " must be a JSON array of {\"name\", \"path\"}"));
  }
  if (j.size() > kMaxAdapters) {
    return absl::InvalidArgumentError(
        absl::StrCat(kVar, " lists ", j.size(), " adapters, at most ", kMaxAdapters));
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < j.size(); ++i) {
    const nlohmann::json& e = j[i];
    const auto name = e.is_object() ? e.find("name") : e.end();
    const auto path = e.is_object() ? e.find("path") : e.end();
    if (!e.is_object() || e.size() != 2 || name == e.end() || path == e.end() ||
        !name->is_string() || !path->is_string() || path->get_ref<const std::string&>().empty() ||
        path->get_ref<const std::string&>().size() > 4096) {
      return absl::InvalidArgumentError(absl::StrCat(
          kVar, "[", i, "] must be {\"name\": NAME, \"path\": DIR} (a path of 1 to 4096 bytes)"));
    }
    AdapterRef a{name->get<std::string>(), path->get<std::string>()};
    if (absl::Status s = CheckAdapterName(a.name); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(kVar, "[", i, "]: ", s.message()));
    }
    if (!seen.insert(a.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(kVar, "[", i, "]: the adapter '", a.name, "' is listed twice"));
    }
    out.push_back(std::move(a));
  }
  return out;
}

std::string EncodeAdapterList(const std::vector<AdapterRef>& adapters) {
  if (adapters.empty()) return "";
  nlohmann::json j = nlohmann::json::array();
  for (const AdapterRef& a : adapters) j.push_back({{"name", a.name}, {"path", a.path}});
  return j.dump();
}

absl::StatusOr<std::optional<int32_t>> AdapterSlotOf(const std::vector<AdapterRef>& adapters,
                                                     const std::string& base,
                                                     const std::string& model) {
  if (model == base) return std::nullopt;
  for (size_t i = 0; i < adapters.size(); ++i) {
    if (adapters[i].name == model) return static_cast<int32_t>(i);
  }
  std::string names = absl::StrCat("'", base, "'");
  for (const AdapterRef& a : adapters) absl::StrAppend(&names, ", '", a.name, "'");
  return absl::NotFoundError(absl::StrCat("the model '", model.substr(0, 200),
                                          "' does not exist; this server serves ", names));
}

}  // namespace shardserve
