#pragma once
// The LoRA adapters a replica serves (issue 54) and the slots they are in: the leader's view,
// kept by the engine's scheduler thread. Adapters are the declared ones (api/adapters.h: ids and
// slots 0..n-1 from the start) and those loaded at runtime (POST /v1/load_lora_adapter: a new
// id each time, so that a name loaded again is never mistaken for its earlier files). A request
// runs once its adapter has a slot: its own, a free one, or the least recently used slot whose
// adapter runs nothing (S-LoRA's and vLLM's LRU; the evicted adapter's ranks keep its host copy).
// Not thread-safe: the engine's lock or its scheduler thread.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

class AdapterRegistry {
 public:
  struct Adapter {
    int64_t id = 0;
    std::string name, path;
    int32_t slot = -1;      // -1: in none (its ranks may hold a host copy)
    int64_t running = 0;    // sequences running it
    uint64_t used = 0;      // the last tick it was placed or finished a sequence (LRU)
    bool removing = false;  // unloaded by the API: no new request; gone once it runs nothing
  };
  explicit AdapterRegistry(int slots) : slots_(slots, -1) {}

  // A new adapter (AlreadyExists naming it when the name is served).
  absl::StatusOr<int64_t> Add(const std::string& name, const std::string& path);
  // The adapter a request's `model` names, if served (not being removed).
  const Adapter* Find(const std::string& name) const;
  const Adapter* Get(int64_t id) const;
  // The API's unload: no new request may name it; its slot and id go once it runs nothing
  // (returned by Reap). NotFound naming it.
  absl::Status Remove(const std::string& name);
  // Removed adapters that run nothing any more, taken out (their slots freed).
  std::vector<Adapter> Reap();

  // Where adapter `id` can run now: its slot (install false), or a slot to install it in (a free
  // one, else the least recently used whose adapter runs nothing: `evicted` its id); nullopt when
  // every slot's adapter is running. Place only says; Installed records it.
  struct Placement {
    int32_t slot = -1;
    bool install = false;
    std::optional<int64_t> evicted;
  };
  std::optional<Placement> Place(int64_t id) const;
  void Installed(int64_t id, int32_t slot);
  // A sequence of `id` starts or ends (its adapter's use is now).
  void Started(int64_t id);
  void Finished(int64_t id);

  int slots() const { return static_cast<int>(slots_.size()); }
  std::vector<const Adapter*> adapters() const;  // by id

 private:
  std::map<int64_t, Adapter> adapters_;
  std::vector<int64_t> slots_;  // each slot's adapter id, -1: free
  int64_t next_id_ = 0;
  uint64_t tick_ = 0;
};

}  // namespace shardserve
