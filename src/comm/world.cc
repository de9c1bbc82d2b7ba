#include "comm/world.h"

#include "absl/strings/str_cat.h"

namespace shardserve {

absl::StatusOr<WorldConfig> WorldConfig::Create(int tp, int pp, int rank) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("tensor parallelism ", tp, " < 1"));
  if (pp < 1) return absl::InvalidArgumentError(absl::StrCat("pipeline parallelism ", pp, " < 1"));
  if (rank < 0 || rank >= tp * pp) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the world of ", tp, " x ", pp, " = ", tp * pp));
  }
  return WorldConfig(tp, pp, rank);
}

std::vector<int> WorldConfig::TpGroup() const {
  std::vector<int> group;
  for (int t = 0; t < tp_; ++t) group.push_back(RankOf(stage(), t));
  return group;
}

std::optional<int> WorldConfig::PrevStageRank() const {
  if (is_first_stage()) return std::nullopt;
  return RankOf(stage() - 1, tp_rank());
}

std::optional<int> WorldConfig::NextStageRank() const {
  if (is_last_stage()) return std::nullopt;
  return RankOf(stage() + 1, tp_rank());
}

std::string WorldConfig::Describe(int rank) const {
  return absl::StrCat("rank ", rank, " (stage ", rank / tp_, ", tp ", rank % tp_, ")");
}

}  // namespace shardserve
