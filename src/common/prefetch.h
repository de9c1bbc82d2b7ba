#pragma once
// Reading a model's bytes at the speed of the disk: the byte ranges a rank will read, read first
// into the page cache by several threads at once, in large sequential pieces (pread), so that
// the disk's queue stays full; the rank's own reads (mmap, slices) then find them in memory.
// A stage's ranks share the work (each a share of the pieces): the node reads each byte once.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

struct FileRange {
  std::string path;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// The ranges merged where they touch or overlap (per file, in file order) and cut into pieces
// of at most `piece` bytes.
std::vector<FileRange> Pieces(std::vector<FileRange> ranges, uint64_t piece);

// Reads the pieces `share` of `shares` takes (piece i when i % shares == share) into the page
// cache with `threads` threads; the bytes read. An unreadable file is an error naming it.
absl::StatusOr<int64_t> ReadIntoPageCache(const std::vector<FileRange>& pieces, int threads,
                                          int share = 0, int shares = 1);

}  // namespace shardserve
