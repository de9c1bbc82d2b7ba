#pragma once
// A whole file mapped read-only (MAP_SHARED: pages come from the page cache, never copied into
// private memory), unmapped when destroyed.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace shardserve {

class MappedFile {
 public:
  // NotFound when the file cannot be opened; an empty file maps to size 0 and no data.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return static_cast<const uint8_t*>(map_); }
  size_t size() const { return size_; }
  // Unmaps the pages this process has touched (madvise MADV_DONTNEED): they leave its resident
  // memory, the mapping stays valid, and a later read faults them in again from the page cache.
  void DropResidentPages() const;

 private:
  MappedFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
};

}  // namespace shardserve
