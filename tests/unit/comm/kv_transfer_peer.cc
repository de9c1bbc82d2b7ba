// A KV puller in a process of its own, for kv_transfer_test: pulls `bytes` from the exporter at
// the (hex) address under the (hex) ticket, over and over, until it is killed.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "comm/kv_transfer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: kv_transfer_peer ADDRESS_HEX TICKET_HEX BYTES\n");
    return 2;
  }
  const std::string address = absl::HexStringToBytes(argv[1]);
  const std::string ticket_bytes = absl::HexStringToBytes(argv[2]);
  if (ticket_bytes.size() != 32) return 2;
  shardserve::KvTicket ticket;
  std::copy(ticket_bytes.begin(), ticket_bytes.end(), ticket.begin());
  const uint64_t bytes = std::strtoull(argv[3], nullptr, 10);
  auto puller = shardserve::KvPuller::Create();
  if (!puller.ok()) return 1;
  std::vector<uint8_t> out(bytes);
  for (;;) {
    absl::Status s =
        (*puller)->Pull(address, ticket, {{0, 0, bytes, out.data()}}, absl::Seconds(30));
    std::fprintf(stdout, "%s\n", s.ok() ? "pulled" : std::string(s.message()).c_str());
    std::fflush(stdout);
  }
}
