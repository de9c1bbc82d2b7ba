#include "common/huge_pages.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"

namespace shardserve {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// The VmFlags of the mapping (/proc/self/smaps) that holds [p, p + bytes), or "" if none does.
std::string VmFlagsOf(const void* p, size_t bytes) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  bool holds = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> begin >> dash >> end && dash == '-') {
      holds = begin <= at && at + bytes <= end;
    } else if (holds && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

// Whether this kernel grants transparent huge pages on madvise (THP "always" or "madvise").
bool ThpOnMadvise() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string setting;
  std::getline(f, setting);
  return setting.find("[always]") != std::string::npos ||
         setting.find("[madvise]") != std::string::npos;
}

TEST(HugePagesTest, ALargeArrayIsItsOwnMappingOnA2MiBBoundaryMarkedForHugePages) {
  const size_t bytes = 5 * kHugePage + 123;
  HugePagesArray a = AllocateHugePages(bytes);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.get()) % kHugePage, 0u);
  EXPECT_EQ(a.get_deleter().mapped, 5 * kHugePage + 4096);
  std::memset(a.get(), 0x5A, bytes);  // every byte writable
  EXPECT_EQ(a[bytes - 1], 0x5A);
  const std::string flags = VmFlagsOf(a.get(), a.get_deleter().mapped);
  ASSERT_NE(flags, "") << "no mapping holds the array";
  if (!ThpOnMadvise()) GTEST_SKIP() << "huge pages: this kernel's THP setting is \"never\"";
  EXPECT_NE(flags.find(" hg"), std::string::npos) << "not advised MADV_HUGEPAGE: " << flags;
}

TEST(HugePagesTest, ASmallArrayComesFromTheHeap) {
  HugePagesArray a = AllocateHugePages(1000);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a.get_deleter().mapped, 0u);
  std::memset(a.get(), 1, 1000);
  EXPECT_NE(AllocateHugePages(0), nullptr);
}

TEST(HugePagesTest, AnArrayLargerThanTheAddressSpaceIsNullNotACrash) {
  EXPECT_EQ(AllocateHugePages(SIZE_MAX / 2), nullptr);
  EXPECT_EQ(AllocateHugePages(SIZE_MAX), nullptr);
}

// The CPU backend keeps an uploaded matrix of 2 MiB or more in such memory.
TEST(HugePagesTest, TheCpuBackendKeepsALargeMatrixInHugePages) {
  auto be = cpu::NewBackend(1);
  const int64_t rows = 1024, cols = 1024;  // F32: 4 MiB
  std::vector<float> host(rows * cols, 0.5f);
  auto w = be->Upload(WeightMatrix{DType::kF32, host.data(), rows, cols, cols});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w->data) % kHugePage, 0u);
  EXPECT_EQ(static_cast<const float*>(w->data)[rows * cols - 1], 0.5f);
  if (!ThpOnMadvise()) GTEST_SKIP() << "huge pages: this kernel's THP setting is \"never\"";
  EXPECT_NE(VmFlagsOf(w->data, rows * cols * sizeof(float)).find(" hg"), std::string::npos);
}

}  // namespace
}  // namespace shardserve
