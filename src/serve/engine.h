#pragma once
// The leader's continuous-batching scheduler (DESIGN.md §5). Requests wait in a bounded queue and
// join the running batch between steps; the running batch is cut into micro-batches that the
// pipeline works on at once; long prompts are fed in chunks of at most max_step_tokens so that
// running sequences keep decoding. KV cache blocks are taken as sequences grow (never reserved
// for max_tokens up front); when the cache runs out, the newest sequence is preempted: its blocks
// are freed and it is requeued first in line, to resume by recomputing its prompt and the
// tokens it already produced (same tokens, same sampler stream). Requests share the batch
// fairly (SubmitGroup). A constrained sequence's masks are computed on grammar threads while
// steps run (EngineOptions::mask_wait, mask_timeout).
//
// Threads: Submit, RequestStream methods, Shutdown and the accessors are safe from any thread;
// Run is the scheduler thread and the only user of the StepExecutor; the grammar threads touch
// only a sequence's constraint and its MaskJob.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "api/adapters.h"
#include "api/speculative.h"
#include "api/worker_env.h"
#include "model/generation.h"
#include "serve/adapter_registry.h"
#include "serve/prefix_cache.h"
#include "serve/step.h"

namespace shardserve {

class Drafter;
class GrammarWorkers;

// Where the engine reports request-level figures (the leader's metrics); may be absent.
struct EngineObserver {
  std::function<void(size_t depth)> queue_depth;
  // After each round of steps: the sequences running, and the prompt tokens still to compute
  // (the waiting sequences' and the running ones' not yet fed): what scales prefill.
  std::function<void(int running, int64_t prompt_tokens)> backlog;
  std::function<void(double seconds)> first_token;
  std::function<void(double seconds)> inter_token;
  std::function<void(int64_t tokens)> generated;
  std::function<void(double seconds)> grammar_mask;  // one sequence's mask for one token
  // A sequence's prompt looked up in the prefix cache: its tokens, and those found cached.
  std::function<void(int64_t queried, int64_t hit)> prefix_lookup;
  // The replica's KV blocks held by sequences, and those holding a cached prefix.
  std::function<void(int64_t used, int64_t cached)> cache_blocks;
  // Names of KV blocks that became cached or were evicted, in order (serve/kv_events.h).
  std::function<void(const std::vector<KvEvent>&)> kv_events;
  // Speculative decoding: a decode step's drafted tokens and those the verification kept.
  std::function<void(int64_t drafted, int64_t accepted)> speculation;
  // A decode step's drafts for sequence `seq`, as the step carries them.
  std::function<void(int64_t seq, const std::vector<int32_t>& drafts)> drafts;
  // Disaggregated decode: a prompt's KV taken from a prefill replica (its duration; an error:
  // the sequence was prefilled here instead).
  std::function<void(double seconds, int64_t bytes, const absl::Status& transfer)> kv_import;
  // After each round of steps: the LoRA adapters (their names) of the running sequences and of
  // the waiting requests, each once, in id order (the base: none).
  std::function<void(const std::vector<std::string>& running,
                     const std::vector<std::string>& waiting)>
      adapters;
};

struct EngineOptions {
  // The worker contract's limits, with its defaults (api/worker_env.h).
  int max_batch = WorkerEnv::Defaults().max_batch_size;  // running sequences
  int max_queue = WorkerEnv::Defaults().max_queue;  // waiting requests; beyond: ResourceExhausted
  int microbatches = 1;
  // Prompt tokens fed per step (decode tokens always fit).
  int64_t max_step_tokens = WorkerEnv::Defaults().max_step_tokens;
  int64_t kv_blocks = 0;  // the replica's KV cache (every rank has the same blocks)
  int64_t kv_block_size = 16;
  // Full blocks stay cached after their sequences end and later sequences with the same prefix
  // share them (serve/prefix_cache.h); spec.serving.prefixCaching turns it off.
  bool prefix_caching = true;
  int64_t max_context = 0;  // prompt + generated tokens per sequence
  int64_t vocab_size = 0;
  std::vector<int64_t> eos_token_ids;
  std::chrono::milliseconds ping_every{1000};  // liveness check of an idle replica
  // Structured output: each constrained sequence's next mask is computed on a grammar thread
  // (serve/grammar_workers.h) while steps run. A step waits at most mask_wait (all its
  // sequences together) for masks still being computed; a sequence whose mask is not ready
  // then sits the step out, and one whose mask takes longer than mask_timeout ends with an
  // error (its own request only).
  int grammar_threads = 2;
  std::chrono::milliseconds mask_wait{10};
  std::chrono::milliseconds mask_timeout{1000};
  bool exit_when_idle = false;  // Run returns once nothing is left to do
  // LoRA: the replica's adapter slots (SHARDSERVE_MAX_LORAS) and the adapters its ranks loaded at
  // start (ids and slots 0..n-1, in order).
  int lora_slots = 0;
  int max_adapters = 16;  // kept at once, declared and loaded (SHARDSERVE_MAX_CPU_LORAS)
  std::vector<AdapterRef> adapters;
  // Speculative decoding (serve/speculative.h): each decode step of a sequence that has not opted
  // out (GenerationRequest::speculative) and has no constraint drafts up to speculative.tokens,
  // from `drafter` (ngram: the engine's own when none is given; draft: the leader's draft model).
  SpeculativeConfig speculative;
  std::shared_ptr<Drafter> drafter;
  // Disaggregated prefill: how long an exported sequence's KV stays offered (and its blocks
  // held) unless released sooner (Engine::ReleaseOffer).
  std::chrono::milliseconds kv_offer_hold{30000};
};

// One sequence's output as the engine produces it. The consumer takes what arrived with Next.
class RequestStream {
 public:
  struct Token {
    int32_t id;
    float logprob;
    std::vector<TokenLogprob> top;
  };
  struct Update {
    std::vector<Token> prompt;  // the prompt's scored tokens (GenerationRequest::prompt_logprobs)
    std::vector<Token> tokens;
    bool finished = false;
    std::string finish_reason;  // "stop" | "length" when finished without error
    absl::Status status;        // the error that ended the sequence, if any
  };

  // What arrived since the last call, waiting up to `timeout` for something new.
  Update Next(std::chrono::milliseconds timeout);
  // The consumer is gone or satisfied (a stop string): the sequence leaves the batch and frees
  // its cache at the next step boundary.
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  // Prompt tokens whose KV came from the prefix cache when the sequence started.
  int64_t cached_tokens() const { return cached_tokens_.load(); }
  void set_cached_tokens(int64_t n) { cached_tokens_.store(n); }
  // Disaggregated prefill: the ticket its prompt's KV is offered under, set before it finishes
  // (with reason "offered"); none when it finished at its first token.
  std::optional<KvTicket> kv_offer() {
    absl::MutexLock lock(&mu_);
    return offer_;
  }
  void set_kv_offer(const KvTicket& ticket) {
    absl::MutexLock lock(&mu_);
    offer_ = ticket;
  }

  // Engine side.
  void Push(Token t);
  void PushPrompt(Token t);
  void Finish(std::string reason, absl::Status status = absl::OkStatus());

 private:
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::vector<Token> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<Token> prompt_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool reported_ ABSL_GUARDED_BY(mu_) = false;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::optional<KvTicket> offer_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> cached_tokens_{0};
};

// Disaggregated serving: what a sequence does with its prompt's KV besides computing it.
struct SequenceKvRole {
  // Prefill: the sequence ends after its first token, its KV offered to a decode replica under a
  // fresh ticket (RequestStream::kv_offer) and held until released or kv_offer_hold passes.
  bool offer = false;
  // Decode: the prompt's KV and first token come from a prefill replica; the sequence starts
  // after them (prefilling here instead when the transfer fails).
  struct Source {
    KvTicket ticket{};
    KvRoleShape shape;
    std::vector<std::string> addresses;
    RequestStream::Token first{};
  };
  std::shared_ptr<const Source> import;
};

class Engine {
 public:
  Engine(StepExecutor* executor, EngineOptions options, EngineObserver observer = {});
  ~Engine();

  // Queues a request. InvalidArgument names a bad parameter or a prompt that cannot fit;
  // ResourceExhausted means the queue is full; Unavailable means the engine stopped or failed.
  absl::StatusOr<std::shared_ptr<RequestStream>> Submit(const GenerationRequest& request);
  // Queues one request's sequences (its prompts, its n choices) together, or none of them. The
  // queue counts requests, and the batch is shared fairly: between tenants by weight, then
  // between a tenant's requests equally. While a request below its share waits, one holding
  // more than its share gives up its newest sequence for it (preempted, resumed later).
  // `kv`: each sequence's part in disaggregated serving (empty: none).
  absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> SubmitGroup(
      const std::vector<GenerationRequest>& requests, const std::vector<SequenceKvRole>& kv = {});
  // The decode replica has the KV offered under `ticket`: its blocks are freed at the next step.
  void ReleaseOffer(const KvTicket& ticket);

  // Schedules until Shutdown (or, with exit_when_idle, until nothing is left), then stops the
  // replica. A replica failure ends every request with the error and is returned.
  absl::Status Run();
  // Stops taking requests; the ones already taken may finish within `drain`, the rest end with
  // Unavailable.
  void Shutdown(std::chrono::milliseconds drain = std::chrono::milliseconds(0));

  // LoRA adapters (serve/adapter_registry.h). The id of the adapter a request's `model` names
  // (NotFound naming it when none is served under that name); load at runtime (its ranks read
  // it while steps run; its first request installs it in a slot); unload (no new request; gone
  // once its sequences end); the names served.
  absl::StatusOr<int64_t> AdapterOf(const std::string& name) const;
  absl::Status LoadAdapter(const std::string& name, const std::string& path);
  absl::Status UnloadAdapter(const std::string& name);
  std::vector<std::string> adapter_names() const;
  // The adapters in slots now (a request of theirs runs without an install): the router's
  // adapter affinity.
  std::vector<std::string> resident_adapters() const;

  bool healthy() const { return healthy_.load(); }
  // Healthy and taking requests (not draining).
  bool accepting() const;
  size_t queue_depth() const;  // waiting requests
  int running() const { return running_count_.load(); }
  int64_t kv_used_blocks() const { return kv_used_.load(); }
  const EngineOptions& options() const { return options_; }

 private:
  struct Sequence;
  struct MaskJob;
  struct DraftMaskJob;
  struct MicroBatch {
    std::vector<Sequence*> seqs;
    bool in_flight = false;
  };

  absl::Status Loop();
  absl::Status Check(const GenerationRequest& request) const;
  size_t WaitingRequests() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Preempts sequences of requests over their share of the batch while a request waits with
  // nothing running, and gives the next free slot to the least served request.
  void MakeRoomForWaitingRequests();
  // Who shares the batch fairly: the sequence's tenant, or its request when it has none.
  static std::string FairUnit(const Sequence& s);
  // Builds the next step of micro-batch `mb`: drops cancelled sequences, admits waiting ones,
  // feeds chunks within the token and cache budgets, preempting when the cache is full.
  StepDesc BuildStep(int mb);
  void Accept(const StepResult& result);
  // The cache's figures and events after the pool changed.
  void ReportCache();
  // The drafts of the batch's decode steps (of the sequences that speculate), asked of the
  // drafter at once.
  absl::flat_hash_map<Sequence*, std::vector<int32_t>> Propose(const MicroBatch& batch);
  // Why s ends after taking `token` ("stop", "length"), or "" when it goes on.
  std::string EndReason(const Sequence* s, int32_t token) const;
  // Offers that were released or have expired: their blocks are freed.
  void EndOffers();
  // Takes s's prompt KV from the prefill replica (s admitted, its cached prefix matched): on
  // success s continues from its first token; otherwise it is prefilled here.
  void Import(Sequence* s);
  void Retire(Sequence* s, const std::string& reason, const absl::Status& status);
  void Preempt(Sequence* s);
  void FailAll(const absl::Status& status);
  // Gives a sequence's blocks back (cached ones stay, evictable) and tells the ranks to drop it.
  void ReleaseBlocks(Sequence* s);
  // Takes the cached blocks that start s's tokens (leaving at least one token to compute).
  void MatchPrefix(Sequence* s);
  // Names s's first `blocks` full blocks (the hash chain over its tokens), as far as not yet.
  void NameBlocks(Sequence* s, int64_t blocks);
  // Names the blocks s has filled since the last call, caching them.
  void RegisterBlocks(Sequence* s);
  // Whether a running sequence is computing the block that would extend s's cached prefix (the
  // n choices of one prompt, the same prompt sent at once): s waits to share it.
  bool PrefixBeingComputed(const Sequence* s) const;
  // Posts the computation of s's next mask (after accepting `tokens`) to a grammar thread.
  void StartMask(Sequence* s, std::vector<int32_t> tokens);
  // s's mask for its next sampled token, waiting for it until `until`; false when the sequence
  // cannot sample in this step (still computing: it sits the step out; or it ended: retired).
  bool TakeMask(Sequence* s, std::chrono::steady_clock::time_point until,
                std::vector<uint32_t>* allowed);
  void MaskDone();
  // Speculation under a grammar: posts the masks of s's drafted rows (a copy of its constraint
  // past each draft) to a grammar thread once s's own mask is done; null when it is not by
  // `until`.
  std::shared_ptr<DraftMaskJob> StartDraftMasks(Sequence* s, std::vector<int32_t> drafts,
                                                std::chrono::steady_clock::time_point until);
  // The drafts the grammar allows (none that completes it) and the masks of the chunk's rows
  // (`allowed`, s's own first), waiting until `until`; no drafts when they are not ready then.
  static void TakeDraftMasks(DraftMaskJob& job, std::chrono::steady_clock::time_point until,
                             std::vector<int32_t>* drafts, std::vector<uint32_t>* allowed);
  // LoRA, on the scheduler thread: the orders queued by LoadAdapter and the adapters unloaded and
  // idle (evicted, forgotten) sent to the ranks; then slots for the adapters of the first waiting
  // sequences (a free slot, or the least recently used idle one), installed; a sequence whose
  // adapter cannot be installed ends with the error.
  absl::Status OrderAdapters();
  void PlaceWaitingAdapters();
  // Whether s may be admitted now (no adapter, or its adapter in a slot).
  bool AdapterReady(const Sequence* s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  StepExecutor* executor_;
  EngineOptions options_;
  EngineObserver observer_;

  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  std::deque<std::unique_ptr<Sequence>> waiting_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point drain_until_ ABSL_GUARDED_BY(mu_);
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t masks_done_ ABSL_GUARDED_BY(mu_) = 0;  // wakes the loop when a mask is ready
  std::vector<KvTicket> offers_released_ ABSL_GUARDED_BY(mu_);
  AdapterRegistry adapters_ ABSL_GUARDED_BY(mu_);
  std::vector<LoraOrder> lora_orders_ ABSL_GUARDED_BY(mu_);  // queued for the ranks
  std::atomic<bool> healthy_{true};
  std::atomic<int> running_count_{0};  // running_.size(), for Submit
  std::atomic<int64_t> kv_used_{0};    // pool_.used(), for the leader's load reports

  // Scheduler thread only.
  std::vector<MicroBatch> mbs_;
  std::deque<int> in_flight_;  // micro-batches, in issue order
  std::vector<std::unique_ptr<Sequence>> running_;
  std::vector<int64_t> release_;
  BlockPool pool_;
  // Exported sequences whose KV is offered, holding their blocks until released or expired.
  std::vector<std::unique_ptr<Sequence>> offered_;
  absl::Status replica_failure_;      // met while building a step (an import's mesh)
  std::shared_ptr<Drafter> drafter_;  // null: no speculation
  // Last: destroyed first, while the jobs it still runs may reach the engine.
  std::unique_ptr<GrammarWorkers> grammar_workers_;
};

// Runs `requests` to completion as one batch on the replica behind `executor` (the one-shot
// path of `shardserve generate`), with `options` sized to hold them all.
absl::StatusOr<std::vector<GenerationResult>> GenerateAll(
    StepExecutor* executor, EngineOptions options, const std::vector<GenerationRequest>& requests,
    EngineObserver observer = {});

}  // namespace shardserve
