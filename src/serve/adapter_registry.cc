#include "serve/adapter_registry.h"

#include "absl/strings/str_cat.h"

namespace shardserve {

absl::StatusOr<int64_t> AdapterRegistry::Add(const std::string& name, const std::string& path) {
  if (Find(name) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat("the LoRA adapter '", name, "' is loaded"));
  }
  const int64_t id = next_id_++;
  adapters_[id] = Adapter{id, name, path, -1, 0, ++tick_, false};
  return id;
}

const AdapterRegistry::Adapter* AdapterRegistry::Find(const std::string& name) const {
  for (const auto& [id, a] : adapters_) {
    if (a.name == name && !a.removing) return &a;
  }
  return nullptr;
}

const AdapterRegistry::Adapter* AdapterRegistry::Get(int64_t id) const {
  auto it = adapters_.find(id);
  return it == adapters_.end() ? nullptr : &it->second;
}

absl::Status AdapterRegistry::Remove(const std::string& name) {
  const Adapter* a = Find(name);
  if (a == nullptr) {
    return absl::NotFoundError(absl::StrCat("the LoRA adapter '", name, "' is not loaded"));
  }
  adapters_[a->id].removing = true;
  return absl::OkStatus();
}

std::vector<AdapterRegistry::Adapter> AdapterRegistry::Reap() {
  std::vector<Adapter> out;
  for (auto it = adapters_.begin(); it != adapters_.end();) {
    if (it->second.removing && it->second.running == 0) {
      if (it->second.slot >= 0) slots_[it->second.slot] = -1;
      out.push_back(std::move(it->second));
      it = adapters_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::optional<AdapterRegistry::Placement> AdapterRegistry::Place(int64_t id) const {
  const Adapter* a = Get(id);
  if (a == nullptr) return std::nullopt;
  if (a->slot >= 0) return Placement{a->slot, false, std::nullopt};
  std::optional<Placement> best;
  uint64_t oldest = UINT64_MAX;
  for (int32_t s = 0; s < static_cast<int32_t>(slots_.size()); ++s) {
    if (slots_[s] < 0) return Placement{s, true, std::nullopt};
    const Adapter& held = adapters_.at(slots_[s]);
    if (held.running == 0 && held.used < oldest) {
      oldest = held.used;
      best = Placement{s, true, held.id};
    }
  }
  return best;
}

void AdapterRegistry::Installed(int64_t id, int32_t slot) {
  if (slots_[slot] >= 0) adapters_[slots_[slot]].slot = -1;
  slots_[slot] = id;
  Adapter& a = adapters_[id];
  a.slot = slot;
  a.used = ++tick_;
}

void AdapterRegistry::Started(int64_t id) {
  Adapter& a = adapters_[id];
  ++a.running;
  a.used = ++tick_;
}

void AdapterRegistry::Finished(int64_t id) {
  Adapter& a = adapters_[id];
  if (a.running > 0) --a.running;
  a.used = ++tick_;
}

std::vector<const AdapterRegistry::Adapter*> AdapterRegistry::adapters() const {
  std::vector<const Adapter*> out;
  for (const auto& [id, a] : adapters_) out.push_back(&a);
  return out;
}

}  // namespace shardserve
