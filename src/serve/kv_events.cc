#include "serve/kv_events.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "comm/json_frame.h"
#include "common/status.h"

namespace shardserve {

using json = nlohmann::json;

void KvEventLog::Apply(const std::vector<KvEvent>& events) {
  if (events.empty()) return;
  absl::MutexLock lock(&mu_);
  for (const KvEvent& e : events) {
    if (e.stored) {
      cached_.insert(e.hash);
    } else {
      cached_.erase(e.hash);
    }
    backlog_.push_back(e);
  }
  while (backlog_.size() > max_backlog_) {
    backlog_.pop_front();
    ++first_;
  }
}

std::vector<BlockHash> KvEventLog::Snapshot(uint64_t* position) const {
  absl::MutexLock lock(&mu_);
  *position = first_ + backlog_.size();
  return std::vector<BlockHash>(cached_.begin(), cached_.end());
}

bool KvEventLog::Since(uint64_t* position, std::chrono::milliseconds timeout,
                       std::vector<KvEvent>* events) const {
  absl::MutexLock lock(&mu_);
  auto more = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return first_ + backlog_.size() > *position || *position < first_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&more), absl::FromChrono(timeout));
  if (*position < first_) return false;
  for (uint64_t p = *position; p < first_ + backlog_.size(); ++p) {
    events->push_back(backlog_[p - first_]);
  }
  *position = first_ + backlog_.size();
  return true;
}

std::string HashHex(const BlockHash& h) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (uint8_t b : h) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

namespace {

json HexList(std::vector<BlockHash>::const_iterator begin,
             std::vector<BlockHash>::const_iterator end) {
  json out = json::array();
  for (auto it = begin; it != end; ++it) out.push_back(HashHex(*it));
  return out;
}

absl::StatusOr<std::vector<BlockHash>> Hashes(const json& m) {
  ASSIGN_OR_RETURN(const json* list, JsonArray(m, "hashes"));
  if (list->size() > kKvHashesPerMessage) {
    return absl::DataLossError(
        absl::StrCat(list->size(), " hashes in one message, over ", kKvHashesPerMessage));
  }
  std::vector<BlockHash> out;
  out.reserve(list->size());
  auto digit = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
  };
  for (const json& h : *list) {
    const std::string* text = h.is_string() ? &h.get_ref<const std::string&>() : nullptr;
    if (text == nullptr || text->size() != 2 * sizeof(BlockHash)) {
      return absl::DataLossError("a hash is not 32 hex digits");
    }
    BlockHash b;
    for (size_t i = 0; i < b.size(); ++i) {
      const int hi = digit((*text)[2 * i]), lo = digit((*text)[2 * i + 1]);
      if (hi < 0 || lo < 0) return absl::DataLossError("a hash is not 32 hex digits");
      b[i] = static_cast<uint8_t>(hi * 16 + lo);
    }
    out.push_back(b);
  }
  return out;
}

}  // namespace

std::string EncodeKvHello(const std::string& model, int64_t block_size, const std::string& epoch) {
  return json{{"type", "hello"}, {"model", model}, {"block_size", block_size}, {"epoch", epoch}}
      .dump();
}

std::vector<std::string> EncodeKvSnapshot(const std::vector<BlockHash>& hashes) {
  std::vector<std::string> out;
  size_t i = 0;
  do {
    const size_t end = std::min(hashes.size(), i + kKvHashesPerMessage);
    out.push_back(json{{"type", "snapshot"},
                       {"hashes", HexList(hashes.begin() + i, hashes.begin() + end)},
                       {"last", end == hashes.size()}}
                      .dump());
    i = end;
  } while (i < hashes.size());
  return out;
}

std::vector<std::string> EncodeKvEvents(const std::vector<KvEvent>& events) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < events.size()) {
    const bool stored = events[i].stored;
    std::vector<BlockHash> run;
    while (i < events.size() && events[i].stored == stored && run.size() < kKvHashesPerMessage) {
      run.push_back(events[i++].hash);
    }
    out.push_back(
        json{{"type", stored ? "stored" : "removed"}, {"hashes", HexList(run.begin(), run.end())}}
            .dump());
  }
  return out;
}

std::string EncodeKvReset() { return json{{"type", "reset"}}.dump(); }

std::string EncodeKvLoad(const ReplicaLoad& l) {
  json m = {{"type", "load"},           {"waiting", l.waiting}, {"running", l.running},
            {"max_batch", l.max_batch}, {"kv_used", l.kv_used}, {"kv_blocks", l.kv_blocks},
            {"accepting", l.accepting}};
  if (l.max_loras > 0) {  // a base-only replica's reports stay as they were
    m["max_loras"] = l.max_loras;
    m["adapters"] = l.adapters;
  }
  return m.dump();
}

absl::StatusOr<KvMessage> DecodeKvMessage(const std::string& line) {
  if (line.size() > kMaxKvEventLine) {
    return absl::DataLossError(absl::StrCat("a KV event line of ", line.size(), " bytes"));
  }
  json m = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!m.is_object()) return absl::DataLossError("a KV event line is not a JSON object");
  KvMessage out;
  absl::Status s = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string type, JsonString(m, "type", 16));
    constexpr int64_t kMax = int64_t{1} << 40;
    if (type == "hello") {
      out.type = KvMessage::Type::kHello;
      ASSIGN_OR_RETURN(out.model, JsonString(m, "model", 256));
      ASSIGN_OR_RETURN(out.epoch, JsonString(m, "epoch", 64));
      ASSIGN_OR_RETURN(out.block_size, JsonInt(m, "block_size", 1, 1 << 20));
    } else if (type == "snapshot" || type == "stored" || type == "removed") {
      out.type = type == "snapshot" ? KvMessage::Type::kSnapshot
                 : type == "stored" ? KvMessage::Type::kStored
                                    : KvMessage::Type::kRemoved;
      ASSIGN_OR_RETURN(out.hashes, Hashes(m));
      if (out.type == KvMessage::Type::kSnapshot) {
        ASSIGN_OR_RETURN(out.last, JsonBool(m, "last"));
      }
    } else if (type == "reset") {
      out.type = KvMessage::Type::kReset;
    } else if (type == "load") {
      out.type = KvMessage::Type::kLoad;
      ASSIGN_OR_RETURN(out.load.waiting, JsonInt(m, "waiting", 0, kMax));
      ASSIGN_OR_RETURN(out.load.running, JsonInt(m, "running", 0, kMax));
      ASSIGN_OR_RETURN(out.load.max_batch, JsonInt(m, "max_batch", 0, kMax));
      ASSIGN_OR_RETURN(out.load.kv_used, JsonInt(m, "kv_used", 0, kMax));
      ASSIGN_OR_RETURN(out.load.kv_blocks, JsonInt(m, "kv_blocks", 0, kMax));
      ASSIGN_OR_RETURN(out.load.accepting, JsonBool(m, "accepting"));
      if (m.contains("max_loras")) {
        ASSIGN_OR_RETURN(out.load.max_loras, JsonInt(m, "max_loras", 0, kMaxKvLoadAdapters));
        const json& a = m.contains("adapters") ? m["adapters"] : json();
        if (!a.is_array() || a.size() > static_cast<size_t>(out.load.max_loras)) {
          return absl::InvalidArgumentError(
              "'adapters' is not a list of at most max_loras adapter names");
        }
        for (const json& name : a) {
          if (!name.is_string() || name.get_ref<const std::string&>().empty() ||
              name.get_ref<const std::string&>().size() > 256) {
            return absl::InvalidArgumentError("'adapters' holds a name that is not 1-256 bytes");
          }
          out.load.adapters.push_back(name.get<std::string>());
        }
      }
    } else {
      return absl::DataLossError(absl::StrCat("a KV event of unknown type '", type, "'"));
    }
    return absl::OkStatus();
  }();
  if (!s.ok()) return absl::DataLossError(absl::StrCat("a malformed KV event: ", s.message()));
  return out;
}

}  // namespace shardserve
