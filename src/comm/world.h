#pragma once
// The parallel topology of one model replica (Megatron style): T tensor-parallel ranks per stage,
// P pipeline stages, global rank = stage * T + tp_rank. Validated once by Create; the getters
// are trivial. Rank 0 (stage 0, tp 0) is the leader.
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

class WorldConfig {
 public:
  static absl::StatusOr<WorldConfig> Create(int tp, int pp, int rank);

  int tp() const { return tp_; }
  int pp() const { return pp_; }
  int rank() const { return rank_; }
  int world_size() const { return tp_ * pp_; }
  int stage() const { return rank_ / tp_; }
  int tp_rank() const { return rank_ % tp_; }
  bool is_leader() const { return rank_ == 0; }
  bool is_first_stage() const { return stage() == 0; }
  bool is_last_stage() const { return stage() == pp_ - 1; }

  int RankOf(int stage, int tp_rank) const { return stage * tp_ + tp_rank; }
  // The T ranks of this rank's stage (its tensor-parallel group), in tp_rank order.
  std::vector<int> TpGroup() const;
  // The rank with this tp_rank in the previous / next stage (pipeline links), if any.
  std::optional<int> PrevStageRank() const;
  std::optional<int> NextStageRank() const;
  // "rank 5 (stage 1, tp 1)" for messages.
  std::string Describe(int rank) const;

 private:
  WorldConfig(int tp, int pp, int rank) : tp_(tp), pp_(pp), rank_(rank) {}
  int tp_, pp_, rank_;
};

}  // namespace shardserve
