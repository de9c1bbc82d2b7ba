#include "comm/handshake.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <list>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "common/text.h"

namespace shardserve {
namespace {

using Bytes32 = std::array<unsigned char, 32>;
constexpr char kMagic[4] = {'S', 'S', 'H', 'S'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kProven = 0, kRefused = 1;

struct Hello {
  char magic[4];
  uint32_t version;
  Bytes32 nonce_a;
};
struct Proof {
  Bytes32 nonce_c;
  uint32_t claim;
  Bytes32 mac;
};
struct Verdict {
  uint32_t verdict;
  Bytes32 mac;
};
static_assert(sizeof(Hello) == 40 && sizeof(Proof) == 68 && sizeof(Verdict) == 36,
              "wire layouts are packed by construction");

absl::StatusOr<Bytes32> Nonce() {
  Bytes32 n;
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    return absl::InternalError("no random bytes for a handshake nonce");
  }
  return n;
}

Bytes32 Mac(const std::string& secret, std::string_view label, std::string_view context,
            const Bytes32& nonce_a, const Bytes32& nonce_c, uint32_t claim) {
  std::string msg;
  msg.append(label.data(), label.size());
  msg.push_back('\0');
  msg.append(context.data(), context.size());
  msg.push_back('\0');
  msg.append(reinterpret_cast<const char*>(nonce_a.data()), nonce_a.size());
  msg.append(reinterpret_cast<const char*>(nonce_c.data()), nonce_c.size());
  msg.append(reinterpret_cast<const char*>(&claim), sizeof(claim));
  Bytes32 out{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out.data(), &len);
  return out;
}

bool Same(const Bytes32& a, const Bytes32& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  auto text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the rendezvous secret: ", text.status().message()));
  }
  const std::string secret(absl::StripAsciiWhitespace(*text));
  if (secret.size() < kMinSecretBytes) {
    return absl::FailedPreconditionError(absl::StrCat("the rendezvous secret in ", path, " has ",
                                                      secret.size(), " bytes; at least ",
                                                      kMinSecretBytes, " are needed"));
  }
  return secret;
}

absl::StatusOr<std::string> NewSecret(size_t bytes) {
  std::string raw(bytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), static_cast<int>(bytes)) != 1) {
    return absl::InternalError("no random bytes for a secret");
  }
  return absl::BytesToHexString(raw);
}

namespace {

constexpr char kSecretDirPrefix[] = "shardserve-secret-";

// Directories of secrets whose run was killed before it could remove them (kill -9): this user's
// shardserve-secret-<pid>-XXXXXX under `tmp` whose process is gone. The secret must not outlive
// its run longer than until the next one starts.
void RemoveOrphanedSecrets(const std::filesystem::path& tmp) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(tmp, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kSecretDirPrefix, 0) != 0) continue;
    const size_t from = sizeof(kSecretDirPrefix) - 1, dash = name.find('-', from);
    int pid;
    if (dash == std::string::npos || !absl::SimpleAtoi(name.substr(from, dash - from), &pid) ||
        pid <= 0) {
      continue;
    }
    struct stat st;
    if (lstat(e.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid()) {
      continue;
    }
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // its run may still be going
    std::filesystem::remove_all(e.path(), ec);
  }
}

}  // namespace

absl::StatusOr<SecretFile> SecretFile::Create() {
  ASSIGN_OR_RETURN(std::string secret, NewSecret());
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  RemoveOrphanedSecrets(tmp);
  std::string dir = (tmp / absl::StrCat(kSecretDirPrefix, getpid(), "-XXXXXX")).string();
  if (mkdtemp(dir.data()) == nullptr) {  // mode 0700
    return absl::InternalError(
        absl::StrCat("cannot make a private directory for the secret: ", std::strerror(errno)));
  }
  SecretFile file(dir);
  const int fd = open(file.path().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 || write(fd, secret.data(), secret.size()) != static_cast<ssize_t>(secret.size())) {
    const int e = errno;
    if (fd >= 0) close(fd);
    return absl::InternalError(absl::StrCat("cannot write ", file.path(), ": ", std::strerror(e)));
  }
  close(fd);
  return file;
}

SecretFile::~SecretFile() {
  if (dir_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

absl::Status ReadBefore(Socket& s, void* data, size_t bytes, Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  if (left.count() <= 0) return absl::DeadlineExceededError("the handshake ran out of time");
  // ReadAll's clock restarts with every byte: bound it by the deadline, then check again.
  RETURN_IF_ERROR(s.ReadAll(data, bytes, left));
  if (std::chrono::steady_clock::now() > deadline) {
    return absl::DeadlineExceededError("the handshake ran out of time");
  }
  return absl::OkStatus();
}

absl::Status ProveToAcceptor(Socket& s, const std::string& secret, std::string_view context,
                             uint32_t claim, Deadline deadline) {
  Hello hello;
  RETURN_IF_ERROR(ReadBefore(s, &hello, sizeof(hello), deadline));
  if (std::memcmp(hello.magic, kMagic, sizeof(kMagic)) != 0 || hello.version != kVersion) {
    return absl::PermissionDeniedError(
        "the peer does not speak shardserve's handshake (version 1)");
  }
  ASSIGN_OR_RETURN(Bytes32 nonce_c, Nonce());
  Proof proof{nonce_c, claim, Mac(secret, "connector", context, hello.nonce_a, nonce_c, claim)};
  RETURN_IF_ERROR(s.WriteAll(&proof, sizeof(proof)));
  Verdict verdict;
  RETURN_IF_ERROR(ReadBefore(s, &verdict, sizeof(verdict), deadline));
  if (verdict.verdict == kRefused) {
    return absl::PermissionDeniedError(
        "the peer refused this process's proof of the replica's secret: the secrets differ");
  }
  if (verdict.verdict != kProven ||
      !Same(verdict.mac, Mac(secret, "acceptor", context, hello.nonce_a, nonce_c, claim))) {
    return absl::PermissionDeniedError(
        "the peer could not prove the replica's secret: it is not this replica's (or the "
        "secrets differ)");
  }
  return absl::OkStatus();
}

absl::StatusOr<Socket> ConnectProven(const std::string& host, int port, const std::string& secret,
                                     std::string_view context, uint32_t claim, Deadline deadline,
                                     std::chrono::milliseconds handshake_timeout) {
  for (auto backoff = std::chrono::milliseconds(20);;
       backoff = std::min(backoff * 2, std::chrono::milliseconds(1000))) {
    ASSIGN_OR_RETURN(Socket sock, ConnectWithRetry(host, port, deadline));
    const absl::Status proven =
        ProveToAcceptor(sock, secret, context, claim,
                        std::min(deadline, std::chrono::steady_clock::now() + handshake_timeout));
    if (proven.ok()) return sock;
    if (absl::IsPermissionDenied(proven)) return proven;
    if (std::chrono::steady_clock::now() + backoff >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the handshake with ", host, ":", port, " failed: ", proven.message()));
    }
    std::this_thread::sleep_for(backoff);  // it was busy with others (or restarting): again
  }
}

absl::StatusOr<uint32_t> VerifyConnector(Socket& s, const std::string& secret,
                                         std::string_view context, Deadline deadline) {
  ASSIGN_OR_RETURN(Bytes32 nonce_a, Nonce());
  Hello hello;
  std::memcpy(hello.magic, kMagic, sizeof(kMagic));
  hello.version = kVersion;
  hello.nonce_a = nonce_a;
  RETURN_IF_ERROR(s.WriteAll(&hello, sizeof(hello)));
  Proof proof;
  RETURN_IF_ERROR(ReadBefore(s, &proof, sizeof(proof), deadline));
  if (!Same(proof.mac, Mac(secret, "connector", context, nonce_a, proof.nonce_c, proof.claim))) {
    Verdict refused{kRefused, {}};
    (void)s.WriteAll(&refused, sizeof(refused));
    return absl::PermissionDeniedError("the connection did not prove the replica's secret");
  }
  Verdict verdict{kProven, Mac(secret, "acceptor", context, nonce_a, proof.nonce_c, proof.claim)};
  RETURN_IF_ERROR(s.WriteAll(&verdict, sizeof(verdict)));
  return proof.claim;
}

absl::Status AcceptVerified(const Socket& listener, const std::string& secret,
                            std::string_view context, int want, Deadline deadline,
                            std::chrono::milliseconds handshake_timeout, const AdmitFn& admit,
                            const std::function<bool()>& stop) {
  struct Pending {
    int fd;
    bool verifying = true;  // a proven connection is no longer the oldest to drop
  };
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
  };
  struct Shared {
    absl::Mutex mu;
    std::list<Pending> pending ABSL_GUARDED_BY(mu);  // oldest first
    int counted ABSL_GUARDED_BY(mu) = 0;
  } shared;
  std::list<Worker> workers;  // this thread's own
  const std::string ctx(context);
  absl::Status result = absl::OkStatus();
  for (;;) {
    for (auto w = workers.begin(); w != workers.end();) {  // reap the finished
      if (w->done->load()) {
        w->thread.join();
        w = workers.erase(w);
      } else {
        ++w;
      }
    }
    {
      absl::MutexLock lock(&shared.mu);
      if (shared.counted >= want) break;
    }
    if (stop && stop()) {
      result = absl::CancelledError("stopped");
      break;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      result = absl::DeadlineExceededError("not every peer proved itself in time");
      break;
    }
    auto conn = Accept(listener, std::min(deadline, now + std::chrono::milliseconds(100)));
    if (!conn.ok()) continue;  // no one yet (or a failed accept): look again
    std::list<Pending>::iterator entry;
    {
      absl::MutexLock lock(&shared.mu);
      int verifying = 0;
      for (const Pending& p : shared.pending) verifying += p.verifying;
      if (verifying >= kMaxPending) {
        for (Pending& p : shared.pending) {
          if (p.verifying) {  // the oldest still unproven makes room
            ::shutdown(p.fd, SHUT_RDWR);
            p.verifying = false;
            break;
          }
        }
      }
      entry = shared.pending.insert(shared.pending.end(), Pending{conn->fd()});
    }
    Worker& w = workers.emplace_back();
    w.thread = std::thread([&, entry, done = w.done, sock = std::move(*conn)]() mutable {
      const Deadline until =
          std::min(deadline, std::chrono::steady_clock::now() + handshake_timeout);
      absl::StatusOr<uint32_t> claim = VerifyConnector(sock, secret, ctx, until);
      bool proven = false;
      {
        absl::MutexLock lock(&shared.mu);
        proven = claim.ok() && entry->verifying;
        entry->verifying = false;
      }
      const bool counts = proven && admit(*claim, sock);
      {
        absl::MutexLock lock(&shared.mu);
        shared.pending.erase(entry);
        if (counts) ++shared.counted;
      }
      done->store(true);
    });
  }
  {
    absl::MutexLock lock(&shared.mu);
    for (Pending& p : shared.pending) {
      if (p.verifying) ::shutdown(p.fd, SHUT_RDWR);
    }
  }
  for (Worker& w : workers) w.thread.join();
  return result;
}

}  // namespace shardserve
