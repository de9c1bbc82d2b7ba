#pragma once
// How the router picks a replica for a request (router/router.h): each replica's score is
//   prefix * (the prompt's full blocks it caches, from the first, / the prompt's full blocks)
//   - load * min(2, its requests / its batch)  - kv * its KV cache usage
//   + adapter * (1 if the request's LoRA adapter is in one of its slots, 1/2 if a slot is free)
// with requests = max(the leader's last report of running + waiting sequences, the router's own
// requests in flight there). A replica that holds the prompt's prefix wins until its batch fills;
// then a hot prefix spreads to the others. A request of an adapter goes where the adapter is
// loaded (no install, nothing evicted), else where a slot is free, unless the load says otherwise
// (the Inference Extension's LoRA affinity). Pure: unit-tested without sockets.
#include <cstdint>
#include <string>
#include <vector>

namespace shardserve {

struct ChoiceWeights {
  double prefix = 2.0;
  double load = 2.0;
  double kv = 1.0;
  double adapter = 1.0;
};

struct Candidate {
  bool routable = false;                            // its KV events stream is live
  int64_t matched_blocks = 0;                       // the prompt's first blocks it caches
  int64_t running = 0, waiting = 0, max_batch = 0;  // its leader's last report
  int64_t in_flight = 0;                            // this router's requests there now
  double kv_usage = 0;                              // used / total KV blocks
  // The request names a LoRA adapter: it is in a slot of the replica, or a slot is free there.
  bool adapter_loaded = false, adapter_room = false;
};

// Why the first replica of a ranking was chosen (the router's decisions_total{reason}).
enum class ChoiceReason {
  kPrefix,    // it caches the longest prefix of the prompt
  kLoad,      // another caches a longer prefix but is loaded
  kNoPrefix,  // no replica caches the prompt's first block: the least loaded
  kNoPrompt,  // the router could not read the prompt (the leader will answer why): by load
  kNoState,   // no replica's stream is live: in turn, as a plain Service would
  kAdapter,   // no replica caches the prompt's first block; it has the request's adapter loaded
};
const char* ChoiceReasonName(ChoiceReason r);

struct Ranking {
  std::vector<int> order;  // every candidate, best first (routable ones before the others)
  ChoiceReason reason = ChoiceReason::kNoState;
  double expected_hit = 0;  // the first's matched blocks / the prompt's blocks
};

// `prompt_blocks` < 0: the prompt is unknown. `turn` breaks ties (a counter the caller advances),
// so that equal replicas take requests in turn.
Ranking RankReplicas(const std::vector<Candidate>& candidates, int64_t prompt_blocks,
                     const ChoiceWeights& weights, uint64_t turn);

}  // namespace shardserve
