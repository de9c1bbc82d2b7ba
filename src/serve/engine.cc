#include "serve/engine.h"

#include <algorithm>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "serve/grammar_workers.h"
#include "serve/speculative.h"

namespace shardserve {

using Clock = std::chrono::steady_clock;

RequestStream::Update RequestStream::Next(std::chrono::milliseconds timeout) {
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  absl::MutexLock lock(&mu_);
  while (pending_.empty() && prompt_.empty() && !finished_) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  }
  Update u;
  u.prompt.swap(prompt_);
  u.tokens.swap(pending_);
  u.finished = finished_;
  u.finish_reason = reason_;
  u.status = status_;
  return u;
}

void RequestStream::Push(Token t) {
  absl::MutexLock lock(&mu_);
  pending_.push_back(std::move(t));
  cv_.SignalAll();
}

void RequestStream::PushPrompt(Token t) {
  absl::MutexLock lock(&mu_);
  prompt_.push_back(std::move(t));
  cv_.SignalAll();
}

void RequestStream::Finish(std::string reason, absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (finished_) return;
  finished_ = true;
  reason_ = std::move(reason);
  status_ = std::move(status);
  cv_.SignalAll();
}

// A constrained sequence's next mask, computed on a grammar thread: shared by the engine's thread
// and the job.
struct Engine::MaskJob {
  absl::Mutex mu;
  absl::CondVar cv;
  bool busy ABSL_GUARDED_BY(mu) = false;
  Clock::time_point since ABSL_GUARDED_BY(mu);  // when the computation was posted
  absl::Status status ABSL_GUARDED_BY(mu);
  bool finished ABSL_GUARDED_BY(mu) = false;  // the grammar is complete: the sequence ends
  std::vector<uint32_t> mask ABSL_GUARDED_BY(mu);
};

// The masks of a constrained sequence's drafted rows (Engine::StartDraftMasks), computed on a
// grammar thread on a copy of its constraint.
struct Engine::DraftMaskJob {
  absl::Mutex mu;
  absl::CondVar cv;
  bool busy ABSL_GUARDED_BY(mu) = true;
  std::vector<int32_t> drafts ABSL_GUARDED_BY(mu);  // those the grammar allows
  std::vector<uint32_t> masks ABSL_GUARDED_BY(mu);  // 1 + drafts.size() rows' masks
  std::shared_ptr<TokenConstraint> copy;            // cancelled when the step goes on without it
};

struct Engine::Sequence {
  int64_t id = 0;
  int64_t group = 0;  // the request it belongs to (its n choices, its prompts): the fair unit
  GenerationRequest request;
  std::shared_ptr<MaskJob> mask;  // with a constraint
  std::shared_ptr<RequestStream> stream = std::make_shared<RequestStream>();
  std::vector<int32_t> generated;
  int64_t fed = 0;  // positions in the replica's KV cache
  // Speculative decoding: the drafts of its step in flight, and the cache positions its next
  // chunk rewinds (the drafts refused).
  int64_t drafted = 0, rewind = 0;
  std::vector<int32_t> table;    // the blocks those positions (and the ones being fed) hold
  std::vector<BlockHash> names;  // of its full blocks, as far as they are named
  int64_t registered = 0;        // table's first blocks offered to the prefix cache
  int64_t scored = 1;            // prompt positions whose log-probability is asked of the ranks
  bool first_start = true;       // not yet admitted (its cached tokens count for usage)
  int64_t admitted = 0;          // admission order: the newest is preempted first
  bool started = false;          // the ranks know its parameters
  bool in_step = false;          // has a chunk in the step being built
  // Disaggregation (SequenceKvRole): the ticket its KV is offered under (prefill), and until it
  // was tried, where its prompt's KV waits (decode).
  std::optional<KvTicket> offer;
  std::shared_ptr<const SequenceKvRole::Source> import;
  Clock::time_point offer_until;
  int mb = -1;
  int32_t lora_slot = -1;        // its adapter's slot while it runs (GenerationRequest::adapter)
  bool adapter_started = false;  // counted among its adapter's running sequences
  Clock::time_point submitted, last_token;

  int64_t total() const {
    return static_cast<int64_t>(request.prompt_ids.size() + generated.size());
  }
  // The prompt positions scored up to (prompt logprobs), 0 when not asked.
  int64_t score_end() const {
    return request.prompt_logprobs >= 0 ? static_cast<int64_t>(request.prompt_ids.size()) : 0;
  }
  int32_t token(int64_t i) const {
    const int64_t p = static_cast<int64_t>(request.prompt_ids.size());
    return i < p ? request.prompt_ids[i] : generated[i - p];
  }
};

Engine::Engine(StepExecutor* executor, EngineOptions options, EngineObserver observer)
    : executor_(executor),
      options_(std::move(options)),
      observer_(std::move(observer)),
      adapters_(options_.lora_slots),
      pool_(options_.kv_blocks, options_.kv_block_size, options_.prefix_caching) {
  options_.microbatches = std::max(1, options_.microbatches);
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < options_.adapters.size(); ++i) {  // the ranks loaded them at start
      absl::StatusOr<int64_t> id =
          adapters_.Add(options_.adapters[i].name, options_.adapters[i].path);
      if (id.ok() && static_cast<int>(i) < adapters_.slots()) {
        adapters_.Installed(*id, static_cast<int32_t>(i));
      }
    }
  }
  mbs_.resize(options_.microbatches);
  drafter_ = options_.speculative.enabled() ? options_.drafter : nullptr;
  if (drafter_ == nullptr && options_.speculative.method == SpeculativeMethod::kMtp) {
    drafter_ = std::make_shared<MtpDrafter>();
  }
  if (drafter_ == nullptr && options_.speculative.method == SpeculativeMethod::kNgram) {
    drafter_ = std::make_shared<NgramDrafter>(options_.speculative);
  }
  grammar_workers_ = std::make_unique<GrammarWorkers>(std::max(1, options_.grammar_threads),
                                                      kGrammarStackBytes, /*max_queued=*/1 << 16);
}

Engine::~Engine() {
  // Masks still being computed give up at once; the workers then join.
  for (const auto& s : running_) {
    if (s->request.constraint) s->request.constraint->Cancel();
  }
  absl::MutexLock lock(&mu_);
  for (const auto& s : waiting_) {
    if (s->request.constraint) s->request.constraint->Cancel();
  }
}

void Engine::MaskDone() {
  {
    absl::MutexLock lock(&mu_);
    ++masks_done_;
  }
  wake_.SignalAll();
}

void Engine::StartMask(Sequence* s, std::vector<int32_t> tokens) {
  std::shared_ptr<MaskJob> job = s->mask;
  {
    absl::MutexLock lock(&job->mu);
    job->busy = true;
    job->since = Clock::now();
    job->mask.clear();
  }
  std::shared_ptr<TokenConstraint> c = s->request.constraint;
  const bool posted = grammar_workers_->Post([this, job, c, tokens = std::move(tokens)] {
    absl::Status st;
    bool finished = false;
    std::vector<uint32_t> mask;
    for (size_t i = 0; i < tokens.size() && st.ok(); ++i) st = c->Accept(tokens[i]);
    if (st.ok()) finished = c->Finished();
    if (st.ok() && !finished) {
      const auto t0 = Clock::now();
      st = c->Allowed(&mask);
      if (observer_.grammar_mask) {
        observer_.grammar_mask(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      if (st.ok() && std::none_of(mask.begin(), mask.end(), [](uint32_t w) { return w; })) {
        st = absl::InvalidArgumentError("the output's grammar allows no token");
      }
    }
    {
      absl::MutexLock lock(&job->mu);
      job->busy = false;
      job->status = std::move(st);
      job->finished = finished;
      job->mask = std::move(mask);
    }
    job->cv.SignalAll();
    MaskDone();
  });
  if (!posted) {
    absl::MutexLock lock(&job->mu);
    job->busy = false;
    job->status = grammar_workers_->error().empty()
                      ? absl::ResourceExhaustedError("the grammar threads' queue is full")
                      : absl::UnavailableError(grammar_workers_->error());
  }
}

// While `job` is busy, until `until` at the latest (job.mu held).
template <typename Job>
static void WaitWhileBusy(Job& job, Clock::time_point until) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu) {
  const absl::Time deadline =
      absl::FromChrono(std::chrono::system_clock::now() + (until - Clock::now()));
  while (job.busy && Clock::now() < until) {
    if (job.cv.WaitWithDeadline(&job.mu, deadline)) break;
  }
}

std::shared_ptr<Engine::DraftMaskJob> Engine::StartDraftMasks(Sequence* s,
                                                              std::vector<int32_t> drafts,
                                                              Clock::time_point until) {
  auto job = std::make_shared<DraftMaskJob>();
  std::vector<uint32_t> first;
  {
    MaskJob& own = *s->mask;
    absl::MutexLock lock(&own.mu);
    WaitWhileBusy(own, until);  // as TakeMask would
    if (own.busy || !own.status.ok() || own.finished) return nullptr;
    first = own.mask;
    // The constraint is idle (its mask is done, the next Accept comes with this step's result).
    job->copy = s->request.constraint->Clone();
  }
  const bool posted =
      grammar_workers_->Post([job, first = std::move(first), drafts = std::move(drafts)]() mutable {
        // Row i's mask is the grammar's after drafts [0, i); a draft the row before does not allow
        // ends the drafts, and so does one that completes the grammar (the sequence ends there: no
        // row after it is sampled).
        std::vector<uint32_t> masks = first, mask = std::move(first);
        size_t kept = 0;
        for (; kept < drafts.size(); ++kept) {
          const auto t = static_cast<size_t>(drafts[kept]);
          if (t / 32 >= mask.size() || !(mask[t / 32] >> (t % 32) & 1u)) break;
          if (!job->copy->Accept(drafts[kept]).ok() || job->copy->Finished()) break;
          if (!job->copy->Allowed(&mask).ok() ||
              std::none_of(mask.begin(), mask.end(), [](uint32_t w) { return w; })) {
            break;
          }
          masks.insert(masks.end(), mask.begin(), mask.end());
        }
        drafts.resize(kept);
        {
          absl::MutexLock lock(&job->mu);
          job->drafts = std::move(drafts);
          job->masks = std::move(masks);
          job->busy = false;
        }
        job->cv.SignalAll();
      });
  return posted ? job : nullptr;
}

void Engine::TakeDraftMasks(DraftMaskJob& job, Clock::time_point until,
                            std::vector<int32_t>* drafts, std::vector<uint32_t>* allowed) {
  absl::MutexLock lock(&job.mu);
  WaitWhileBusy(job, until);
  if (job.busy) {  // the step goes on without drafts; the copy gives up
    job.copy->Cancel();
    drafts->clear();
    return;
  }
  *drafts = job.drafts;
  *allowed = job.masks;
}

bool Engine::TakeMask(Sequence* s, Clock::time_point until, std::vector<uint32_t>* allowed) {
  MaskJob& job = *s->mask;
  absl::Status status;
  bool finished = false;
  {
    absl::MutexLock lock(&job.mu);
    WaitWhileBusy(job, until);
    if (job.busy) {
      if (Clock::now() - job.since <= options_.mask_timeout) return false;  // sits this step out
      status = absl::InvalidArgumentError(
          absl::StrCat("the output's grammar took longer than ", options_.mask_timeout.count(),
                       " ms to compute which tokens may come next; simplify it"));
      s->request.constraint->Cancel();
    } else {
      status = job.status;
      finished = job.finished;
      if (status.ok() && !finished) *allowed = job.mask;
    }
  }
  if (!status.ok()) {
    Retire(s, "", status);
    return false;
  }
  if (finished) {
    Retire(s, "stop", absl::OkStatus());
    return false;
  }
  return true;
}

absl::Status Engine::Check(const GenerationRequest& request) const {
  RETURN_IF_ERROR(request.params.Validate());
  const int64_t prompt = static_cast<int64_t>(request.prompt_ids.size());
  if (prompt == 0) return absl::InvalidArgumentError("the prompt is empty");
  for (int32_t id : request.prompt_ids) {
    if (id < 0 || id >= options_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt token id ", id, " is outside the vocabulary [0, ", options_.vocab_size, ")"));
    }
  }
  const int64_t limit = std::min(options_.max_context, options_.kv_blocks * options_.kv_block_size);
  if (prompt > limit || request.params.max_tokens > limit - prompt) {  // no overflow
    return absl::InvalidArgumentError(
        absl::StrCat("this model's maximum context length is ", limit, " tokens; the prompt holds ",
                     prompt, " and max_tokens asks for ", request.params.max_tokens, " more"));
  }
  if (request.prompt_logprobs < -1 || request.prompt_logprobs > options_.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_logprobs ", request.prompt_logprobs,
                                                   " is outside [-1, ", options_.vocab_size, "]"));
  }
  for (int32_t id : request.resumed) {
    if (id < 0 || id >= options_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "resumed token id ", id, " is outside the vocabulary [0, ", options_.vocab_size, ")"));
    }
  }
  if (!request.resumed.empty() &&
      static_cast<int64_t>(request.resumed.size()) >= request.params.max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("a resumed sequence has ", request.resumed.size(),
                     " tokens of its max_tokens ", request.params.max_tokens, " already"));
  }
  for (const auto& [id, bias] : request.params.logit_bias) {
    if (id >= options_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_bias token id ", id, " is outside the vocabulary [0, ", options_.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<RequestStream>> Engine::Submit(const GenerationRequest& request) {
  ASSIGN_OR_RETURN(auto streams, SubmitGroup({request}));
  return streams[0];
}

absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> Engine::SubmitGroup(
    const std::vector<GenerationRequest>& requests, const std::vector<SequenceKvRole>& kv) {
  if (requests.empty()) return absl::InvalidArgumentError("a request with no sequence");
  if (!kv.empty() && kv.size() != requests.size()) {
    return absl::InvalidArgumentError("a KV role for every sequence, or none");
  }
  for (const GenerationRequest& r : requests) RETURN_IF_ERROR(Check(r));
  for (const SequenceKvRole& role : kv) {
    if (role.import &&
        (role.import->first.id < 0 || role.import->first.id >= options_.vocab_size)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the prefilled first token ", role.import->first.id,
                       " is outside the vocabulary [0, ", options_.vocab_size, ")"));
    }
  }
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto seq = std::make_unique<Sequence>();
    seq->request = requests[i];
    seq->submitted = Clock::now();
    seq->request.params.SetEndIds(options_.eos_token_ids);  // what min_tokens holds back
    if (!kv.empty() && kv[i].offer) {
      ASSIGN_OR_RETURN(seq->offer, NewKvTicket());
    }
    // Decode after a prefill replica: its first token is already there.
    const RequestStream::Token* first =
        !kv.empty() && kv[i].import ? &kv[i].import->first : nullptr;
    if (first) {
      seq->import = kv[i].import;
      seq->generated.push_back(first->id);
      seq->stream->Push(*first);
      seq->last_token = seq->submitted;
    }
    // Migrated from another replica: its output so far, which its client already has.
    seq->generated.insert(seq->generated.end(), seq->request.resumed.begin(),
                          seq->request.resumed.end());
    if (seq->request.constraint) {
      seq->mask = std::make_shared<MaskJob>();
      // Ready by the time its prompt is computed (after the output it starts with).
      StartMask(seq.get(), seq->generated);
    }
    streams.push_back(seq->stream);
    seqs.push_back(std::move(seq));
  }
  // A first token that ends its sequence leaves nothing to decode (nor KV to take).
  std::erase_if(seqs, [&](const std::unique_ptr<Sequence>& seq) {
    if (!seq->import) return false;
    const std::string end = EndReason(seq.get(), seq->generated[0]);
    if (end.empty()) return false;
    if (seq->request.constraint) seq->request.constraint->Cancel();
    seq->stream->Finish(end);
    return true;
  });
  if (seqs.empty()) return streams;
  size_t depth;
  {
    absl::MutexLock lock(&mu_);
    absl::Status refused;
    if (!accepting_) {
      refused = absl::UnavailableError("the server is not serving");
    } else {
      // A queue place per request, however many sequences it has; requests that the batch's
      // free slots will take at the next step do not count as queued.
      const int free_slots = std::max(0, options_.max_batch - running_count_.load());
      if (WaitingRequests() >= static_cast<size_t>(options_.max_queue + free_slots)) {
        refused = absl::ResourceExhaustedError(
            absl::StrCat("the request queue is full (", options_.max_queue, " waiting)"));
      }
    }
    if (!refused.ok()) {
      for (const auto& seq : seqs) {
        if (seq->request.constraint) seq->request.constraint->Cancel();
      }
      return refused;
    }
    const int64_t group = next_id_;
    for (auto& seq : seqs) {
      seq->id = next_id_++;
      seq->group = group;
      waiting_.push_back(std::move(seq));
    }
    depth = WaitingRequests();
  }
  wake_.SignalAll();
  if (observer_.queue_depth) observer_.queue_depth(depth);
  return streams;
}

size_t Engine::WaitingRequests() const {
  absl::flat_hash_set<int64_t> groups;
  for (const auto& s : waiting_) groups.insert(s->group);
  return groups.size();
}

void Engine::ReleaseOffer(const KvTicket& ticket) {
  {
    absl::MutexLock lock(&mu_);
    offers_released_.push_back(ticket);
  }
  wake_.SignalAll();
}

void Engine::EndOffers() {
  std::vector<KvTicket> released;
  {
    absl::MutexLock lock(&mu_);
    released.swap(offers_released_);
  }
  const auto now = Clock::now();
  std::erase_if(offered_, [&](const std::unique_ptr<Sequence>& s) {
    if (now < s->offer_until &&
        std::find(released.begin(), released.end(), *s->offer) == released.end()) {
      return false;
    }
    ReleaseBlocks(s.get());  // the ranks withdraw the offer as they drop the sequence
    return true;
  });
}

void Engine::Import(Sequence* s) {
  std::shared_ptr<const SequenceKvRole::Source> from = std::move(s->import);
  const int64_t bs = options_.kv_block_size;
  const int64_t positions = static_cast<int64_t>(s->request.prompt_ids.size());
  const size_t matched = s->table.size();
  KvImport im;
  im.seq = s->id;
  im.ticket = from->ticket;
  im.source = from->shape;
  im.addresses = from->addresses;
  im.positions = positions;
  im.skip_blocks = static_cast<int64_t>(matched);
  while (static_cast<int64_t>(s->table.size()) * bs < positions) {
    s->table.push_back(pool_.Allocate());  // the room was checked at admission
  }
  im.blocks = s->table;
  const auto t0 = Clock::now();
  absl::Status transfer;
  int64_t bytes = 0;
  replica_failure_ = executor_->ImportKv(im, &transfer, &bytes);
  if (!replica_failure_.ok()) return;
  if (observer_.kv_import) {
    observer_.kv_import(std::chrono::duration<double>(Clock::now() - t0).count(), bytes, transfer);
  }
  if (transfer.ok()) {
    s->fed = positions;
    return;
  }
  // Prefilled here: the blocks past its cached prefix are given back (written or not).
  pool_.Release(std::vector<int32_t>(s->table.begin() + static_cast<std::ptrdiff_t>(matched),
                                     s->table.end()));
  s->table.resize(matched);
}

void Engine::Shutdown(std::chrono::milliseconds drain) {
  {
    absl::MutexLock lock(&mu_);
    if (!shutdown_) drain_until_ = Clock::now() + drain;
    shutdown_ = true;
    accepting_ = false;
  }
  wake_.SignalAll();
}

bool Engine::accepting() const {
  absl::MutexLock lock(&mu_);
  return accepting_ && healthy_.load();
}

size_t Engine::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return WaitingRequests();
}

void Engine::ReleaseBlocks(Sequence* s) {
  if (s->started) release_.push_back(s->id);
  pool_.Release(s->table);
  s->table.clear();
  s->registered = 0;
  s->fed = 0;
  s->drafted = s->rewind = 0;
  s->started = false;
  if (drafter_) drafter_->Forget(s->id);
}

// The hash chain runs over the sequence's tokens in order, one name per full block; the names
// computed once are kept (a preempted sequence's tokens do not change).
void Engine::MatchPrefix(Sequence* s) {
  const int64_t bs = options_.kv_block_size;
  // Prompt log-probabilities need every prompt row computed.
  if (!pool_.caching() || s->scored < s->score_end()) return;
  // At least the last token is computed: its logits choose the next.
  const int64_t full = (s->total() - 1) / bs;
  NameBlocks(s, full);
  s->table = pool_.Match(std::vector<BlockHash>(s->names.begin(), s->names.begin() + full));
  s->fed = static_cast<int64_t>(s->table.size()) * bs;
  s->registered = static_cast<int64_t>(s->table.size());
}

bool Engine::PrefixBeingComputed(const Sequence* s) const {
  const size_t next = s->table.size();
  if (!pool_.caching() || next >= s->names.size()) return false;
  for (const auto& r : running_) {
    for (size_t k = static_cast<size_t>(r->registered); k < r->names.size(); ++k) {
      if (r->names[k] == s->names[next]) return true;
    }
  }
  return false;
}

void Engine::NameBlocks(Sequence* s, int64_t blocks) {
  const int64_t bs = options_.kv_block_size;
  std::vector<int32_t> tokens(bs);
  while (static_cast<int64_t>(s->names.size()) < blocks) {
    const int64_t b = static_cast<int64_t>(s->names.size());
    for (int64_t i = 0; i < bs; ++i) tokens[i] = s->token(b * bs + i);
    s->names.push_back(HashBlock(b == 0 ? std::nullopt : std::optional(s->names[b - 1]),
                                 tokens.data(), bs, s->request.cache_salt));
  }
}

void Engine::RegisterBlocks(Sequence* s) {
  const int64_t full = s->fed / options_.kv_block_size;
  NameBlocks(s, full);
  for (; s->registered < full; ++s->registered) {
    pool_.Register(s->table[s->registered], s->names[s->registered]);
  }
}

void Engine::Retire(Sequence* s, const std::string& reason, const absl::Status& status) {
  if (s->request.constraint) s->request.constraint->Cancel();  // a mask in progress stops
  if (std::exchange(s->adapter_started, false)) {
    absl::MutexLock lock(&mu_);
    adapters_.Finished(s->request.adapter);
  }
  if (reason == "offered") {  // its KV waits for the decode replica, its blocks held
    s->stream->set_kv_offer(*s->offer);
    s->offer_until = Clock::now() + options_.kv_offer_hold;
  } else {
    ReleaseBlocks(s);
  }
  s->stream->Finish(reason, status);
  if (s->mb >= 0) std::erase(mbs_[s->mb].seqs, s);
  auto it = std::find_if(running_.begin(), running_.end(),
                         [s](const std::unique_ptr<Sequence>& p) { return p.get() == s; });
  if (it != running_.end()) {
    if (reason == "offered") offered_.push_back(std::move(*it));
    running_.erase(it);
  }
  running_count_.store(static_cast<int>(running_.size()));
}

void Engine::Preempt(Sequence* s) {
  ReleaseBlocks(s);
  if (std::exchange(s->adapter_started, false)) {
    absl::MutexLock lock(&mu_);
    adapters_.Finished(s->request.adapter);
  }
  s->lora_slot = -1;
  std::erase(mbs_[s->mb].seqs, s);
  s->mb = -1;
  auto it = std::find_if(running_.begin(), running_.end(),
                         [s](const std::unique_ptr<Sequence>& p) { return p.get() == s; });
  std::unique_ptr<Sequence> owned = std::move(*it);
  running_.erase(it);
  running_count_.store(static_cast<int>(running_.size()));
  absl::MutexLock lock(&mu_);
  waiting_.push_front(std::move(owned));
}

std::string Engine::FairUnit(const Sequence& s) {
  return s.request.tenant.empty() ? absl::StrCat("#", s.group) : s.request.tenant;
}

void Engine::MakeRoomForWaitingRequests() {
  while (static_cast<int>(running_.size()) >= options_.max_batch) {
    // A more urgent request waiting: the newest sequence of the least urgent running one that
    // can leave now (not in a step in flight) makes room for it.
    int64_t urgent = std::numeric_limits<int64_t>::max();
    struct Waiter {
      std::string unit;
      int64_t group;
      int64_t priority;
      double weight;
    };
    std::vector<Waiter> waiters;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& s : waiting_) {
        if (!AdapterReady(s.get())) continue;  // it could not take the slot made for it
        urgent = std::min(urgent, s->request.priority);
        waiters.push_back({FairUnit(*s), s->group, s->request.priority, s->request.weight});
      }
    }
    Sequence* victim = nullptr;
    for (const auto& s : running_) {
      if (s->request.priority <= urgent || mbs_[s->mb].in_flight) continue;
      if (victim == nullptr || s->request.priority > victim->request.priority ||
          (s->request.priority == victim->request.priority && s->admitted > victim->admitted)) {
        victim = s.get();
      }
    }
    if (victim != nullptr) {
      Preempt(victim);
      continue;
    }
    // Fair sharing at the most urgent priority, in two levels: between fair units (tenants),
    // each to its weight's share of the batch; inside a unit, between its requests, each to an
    // equal part of the unit's share. A waiting request whose unit is below its share takes a
    // slot from the unit most over its share; failing that, one below its part takes a slot
    // from the request of its own unit most over its part (a tenant's big request leaves the
    // tenant's other requests their parts). The victim is the newest sequence of the request
    // most over its part.
    absl::flat_hash_map<std::string, double> weight;  // units waiting or running
    absl::flat_hash_map<std::string, int> held;       // running sequences by unit
    absl::flat_hash_map<int64_t, int> held_by_group;  // and by request
    absl::flat_hash_map<std::string, absl::flat_hash_set<int64_t>> groups;  // requests by unit
    for (const Waiter& w : waiters) {
      if (w.priority != urgent) continue;
      weight[w.unit] = w.weight;
      groups[w.unit].insert(w.group);
    }
    for (const auto& s : running_) {
      if (s->request.priority != urgent) continue;
      const std::string unit = FairUnit(*s);
      ++held[unit];
      ++held_by_group[s->group];
      weight[unit] = s->request.weight;
      groups[unit].insert(s->group);
    }
    double total = 0;
    for (const auto& [unit, w] : weight) total += w;
    auto share = [&](const std::string& unit) {
      return std::max(1.0, options_.max_batch * weight[unit] / total);
    };
    auto part = [&](const std::string& unit) {  // of each of the unit's requests
      return std::max(1.0, share(unit) / static_cast<double>(groups[unit].size()));
    };
    bool across = false;                      // a unit below its share waits
    absl::flat_hash_set<std::string> within;  // units with a request below its part waiting
    for (const Waiter& w : waiters) {
      if (w.priority != urgent) continue;
      across |= held[w.unit] + 1 <= share(w.unit);
      if (held_by_group[w.group] + 1 <= part(w.unit)) within.insert(w.unit);
    }
    // Candidates ranked by how far their unit is over its share (across units only), then how
    // far their request is over its part, then the newest.
    auto rank = [&](const Sequence& s, bool by_unit) {
      const std::string unit = FairUnit(s);
      return std::tuple(by_unit ? held[unit] / share(unit) : 0.0,
                        held_by_group[s.group] / part(unit), s.admitted);
    };
    for (bool by_unit : {true, false}) {
      if (by_unit ? !across : within.empty()) continue;
      for (const auto& s : running_) {
        const std::string unit = FairUnit(*s);
        if (s->request.priority != urgent || mbs_[s->mb].in_flight) continue;
        if (by_unit ? held[unit] <= share(unit)
                    : !within.contains(unit) || held_by_group[s->group] <= part(unit)) {
          continue;
        }
        if (victim == nullptr || rank(*s, by_unit) > rank(*victim, by_unit)) victim = s.get();
      }
      if (victim != nullptr) break;
    }
    if (victim == nullptr) return;
    Preempt(victim);
  }
}

StepDesc Engine::BuildStep(int mb) {
  MicroBatch& batch = mbs_[mb];
  for (Sequence* s : std::vector<Sequence*>(batch.seqs)) {
    if (s->stream->cancelled()) Retire(s, "cancelled", absl::OkStatus());
  }
  {
    absl::MutexLock lock(&mu_);
    std::erase_if(waiting_, [](const std::unique_ptr<Sequence>& s) {
      if (!s->stream->cancelled()) return false;
      if (s->request.constraint) s->request.constraint->Cancel();
      s->stream->Finish("cancelled");
      return true;
    });
  }
  EndOffers();
  PlaceWaitingAdapters();
  MakeRoomForWaitingRequests();
  int64_t admitted_order = 0;
  absl::flat_hash_map<int64_t, int> held;            // running sequences by request
  absl::flat_hash_map<std::string, int> held_units;  // and by fair unit (tenant)
  for (const auto& s : running_) {
    admitted_order = std::max(admitted_order, s->admitted);
    ++held[s->group];
    ++held_units[FairUnit(*s)];
  }
  {
    absl::MutexLock lock(&mu_);
    const size_t m = mbs_.size();
    const size_t share = (running_.size() + waiting_.size() + m - 1) / m;
    while (!waiting_.empty() && static_cast<int>(running_.size()) < options_.max_batch &&
           batch.seqs.size() < share) {
      // Next: the most urgent waiting sequence; among equals, that of the tenant with the
      // fewest running per weight, then of the request with the fewest running, first in line
      // among equals (a preempted sequence is first in line).
      // A sequence whose adapter has no slot yet waits for it; the others pass it.
      size_t next = waiting_.size();
      auto before = [&](const Sequence& a, const Sequence& b) {
        if (a.request.priority != b.request.priority) {
          return a.request.priority < b.request.priority;
        }
        const double ua = held_units[FairUnit(a)] / a.request.weight;
        const double ub = held_units[FairUnit(b)] / b.request.weight;
        if (ua != ub) return ua < ub;
        return held[a.group] < held[b.group];
      };
      for (size_t i = 0; i < waiting_.size(); ++i) {
        if (!AdapterReady(waiting_[i].get())) continue;
        if (next == waiting_.size() || before(*waiting_[i], *waiting_[next])) next = i;
      }
      if (next == waiting_.size()) break;
      Sequence* s = waiting_[next].get();
      MatchPrefix(s);
      const int64_t need = (s->total() + options_.kv_block_size) / options_.kv_block_size -
                           static_cast<int64_t>(s->table.size());
      // First in line waits for room, or for the blocks of its prefix being computed now.
      if (need > pool_.available() || PrefixBeingComputed(s)) {
        ReleaseBlocks(s);
        break;
      }
      if (s->first_start && pool_.caching()) {  // what its first admission found cached
        s->first_start = false;
        s->stream->set_cached_tokens(s->fed);
        if (observer_.prefix_lookup) {
          observer_.prefix_lookup(static_cast<int64_t>(s->request.prompt_ids.size()), s->fed);
        }
      }
      if (s->import) Import(s);
      if (s->request.adapter >= 0) {
        s->lora_slot = adapters_.Get(s->request.adapter)->slot;
        adapters_.Started(s->request.adapter);
        s->adapter_started = true;
      }
      s->mb = mb;
      s->admitted = ++admitted_order;
      ++held[s->group];
      ++held_units[FairUnit(*s)];
      batch.seqs.push_back(s);
      running_.push_back(std::move(waiting_[next]));
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(next));
    }
    running_count_.store(static_cast<int>(running_.size()));
  }

  StepDesc desc;
  desc.microbatch = mb;
  int64_t budget = options_.max_step_tokens;
  const Clock::time_point mask_until = Clock::now() + options_.mask_wait;
  auto blocks_for = [&](int64_t positions) {
    return (positions + options_.kv_block_size - 1) / options_.kv_block_size;
  };
  // The least urgent, then newest, sequence that holds cache and has no chunk in this step or
  // in flight, and is not more urgent than `for_s`.
  auto victim = [&](const Sequence* for_s) -> Sequence* {
    Sequence* v = nullptr;
    for (const auto& s : running_) {
      if (s->in_step || s->table.empty() || mbs_[s->mb].in_flight) continue;
      if (s->request.priority < for_s->request.priority) continue;
      if (v == nullptr || s->request.priority > v->request.priority ||
          (s->request.priority == v->request.priority && s->admitted > v->admitted)) {
        v = s.get();
      }
    }
    return v;
  };
  absl::flat_hash_map<Sequence*, std::vector<int32_t>> proposed = Propose(batch);
  // A constrained sequence's drafts are checked against its grammar, and their rows' masks
  // computed, on the grammar threads while the other chunks are built.
  absl::flat_hash_map<Sequence*, std::shared_ptr<DraftMaskJob>> draft_masks;
  for (auto& [s, d] : proposed) {
    if (s->request.constraint == nullptr) continue;
    if (std::shared_ptr<DraftMaskJob> job = StartDraftMasks(s, d, mask_until)) draft_masks[s] = job;
  }
  for (Sequence* s : std::vector<Sequence*>(batch.seqs)) {
    if (s->mb != mb) continue;  // preempted by an earlier sequence of this step
    const int64_t remaining = s->total() - s->fed;
    const int64_t n = remaining == 1 ? 1 : std::min(remaining, budget);
    if (n <= 0) continue;
    // Structured output: the ids the token this chunk samples may take, from the sequence's
    // grammar as its tokens so far left it (computed on a grammar thread; see TakeMask).
    std::vector<uint32_t> allowed;
    if (s->request.constraint != nullptr && s->fed + n == s->total() &&
        !TakeMask(s, mask_until, &allowed)) {
      continue;
    }
    // A decode step may carry drafts, positions after its token (serve/speculative.h).
    std::vector<int32_t> drafts;
    if (auto it = proposed.find(s); it != proposed.end() && s->fed + 1 == s->total()) {
      drafts = std::move(it->second);
    }
    const size_t mask_words = allowed.size();  // a row's
    if (s->request.constraint != nullptr && !drafts.empty()) {
      auto job = draft_masks.find(s);
      if (job == draft_masks.end()) {
        drafts.clear();
      } else {
        TakeDraftMasks(*job->second, mask_until, &drafts, &allowed);
      }
    }
    if (static_cast<int64_t>(drafts.size()) > budget - n) {
      drafts.resize(std::max<int64_t>(0, budget - n));
    }
    const int64_t d = static_cast<int64_t>(drafts.size());
    if (mask_words > 0) allowed.resize((1 + d) * mask_words);
    s->in_step = true;  // never its own victim while it competes for room
    bool fits = true;
    while (blocks_for(s->fed + n + d) - static_cast<int64_t>(s->table.size()) > pool_.available()) {
      Sequence* v = victim(s);
      if (v == nullptr) {
        fits = false;
        break;
      }
      Preempt(v);
    }
    if (!fits) {
      s->in_step = false;
      Preempt(s);
      continue;
    }
    budget -= n + d;
    StepChunk chunk;
    chunk.seq = s->id;
    chunk.tokens.reserve(n + d);
    for (int64_t i = s->fed; i < s->fed + n; ++i) chunk.tokens.push_back(s->token(i));
    chunk.tokens.insert(chunk.tokens.end(), drafts.begin(), drafts.end());
    chunk.drafts = s->drafted = d;
    if (d > 0 && observer_.drafts) observer_.drafts(s->id, drafts);
    chunk.rewind = std::exchange(s->rewind, 0);
    chunk.sample = s->fed + n == s->total();
    chunk.lora_slot = s->lora_slot;
    chunk.allowed = std::move(allowed);
    // Row i predicts token fed + i + 1: the prompt's tokens in [fed + 1, fed + n] not yet scored.
    if (const int64_t q0 = std::max(s->scored, s->fed + 1),
        q1 = std::min(s->fed + n + 1, s->score_end());
        q1 > q0) {
      chunk.score_from = q0 - 1 - s->fed;
      chunk.score.assign(s->request.prompt_ids.begin() + q0, s->request.prompt_ids.begin() + q1);
      chunk.score_top = s->request.prompt_logprobs;
      s->scored = q1;
    }
    // Prefill for a decode replica: offered once computed (its first token then ends it).
    if (s->offer && chunk.sample && s->generated.empty()) chunk.offer = s->offer;
    if (!s->started) {
      chunk.params = s->request.params;
      chunk.draws = static_cast<int64_t>(s->generated.size());
      chunk.prompt_tokens = static_cast<int64_t>(s->request.prompt_ids.size());
      chunk.start = s->fed;                       // a cached prefix: the ranks skip it
      chunk.cached = s->table;                    // and read its blocks
      if (s->request.params.ProcessesLogits()) {  // the sampler reads the skipped tokens too
        for (int64_t i = 0; i < s->fed; ++i) chunk.history.push_back(s->token(i));
      }
      s->started = true;
    }
    // Multi-token prediction reads each row's next token: a prompt chunk's last row, the next
    // chunk's first.
    if (!chunk.sample && options_.speculative.method == SpeculativeMethod::kMtp) {
      chunk.next = s->token(s->fed + n);
    }
    s->fed += n;
    while (static_cast<int64_t>(s->table.size()) < blocks_for(s->fed + d)) {
      chunk.blocks.push_back(pool_.Allocate());
      s->table.push_back(chunk.blocks.back());
    }
    desc.chunks.push_back(std::move(chunk));
  }
  for (Sequence* s : batch.seqs) s->in_step = false;
  desc.release.swap(release_);
  ReportCache();
  return desc;
}

void Engine::ReportCache() {
  kv_used_.store(pool_.used());
  if (observer_.cache_blocks) observer_.cache_blocks(pool_.used(), pool_.cached());
  std::vector<KvEvent> events = pool_.TakeEvents();
  if (observer_.kv_events && !events.empty()) observer_.kv_events(events);
}

void Engine::Accept(const StepResult& result) {
  MicroBatch& batch = mbs_[result.microbatch];
  batch.in_flight = false;
  // The step is done on every rank: the blocks it filled hold their KV and may be shared.
  for (Sequence* s : batch.seqs) RegisterBlocks(s);
  ReportCache();
  for (const StepToken& t : result.prompt) {
    auto it = std::find_if(batch.seqs.begin(), batch.seqs.end(),
                           [&](Sequence* s) { return s->id == t.seq; });
    if (it != batch.seqs.end()) (*it)->stream->PushPrompt({t.token, t.logprob, t.top});
  }
  const auto now = Clock::now();
  // A sequence that drafted gets its kept drafts and one token more: its tokens here, those
  // taken so far, and the drafts kept.
  struct Got {
    int64_t count = 0, taken = 0, kept = 0;
  };
  absl::flat_hash_map<int64_t, Got> got;
  for (const StepToken& t : result.tokens) ++got[t.seq].count;
  // Multi-token prediction's drafts, for each sequence once it has this step's tokens.
  for (const StepToken& d : result.drafts) {
    auto it = std::find_if(batch.seqs.begin(), batch.seqs.end(),
                           [&](Sequence* s) { return s->id == d.seq; });
    if (it == batch.seqs.end() || drafter_ == nullptr) continue;
    drafter_->Drafted(d.seq, (*it)->total() + got[d.seq].count, d.token);
  }
  for (const StepToken& t : result.tokens) {
    auto it = std::find_if(batch.seqs.begin(), batch.seqs.end(),
                           [&](Sequence* s) { return s->id == t.seq; });
    if (it == batch.seqs.end()) continue;
    Sequence* s = *it;
    if (s->stream->cancelled()) continue;  // retired when its micro-batch is next built
    Got& g = got[t.seq];
    if (g.taken++ == 0 && s->drafted > 0) {
      g.kept = std::min(g.count - 1, s->drafted);
      s->rewind = s->drafted - g.kept;
      if (observer_.speculation) observer_.speculation(s->drafted, g.kept);
      s->drafted = 0;
    }
    s->generated.push_back(t.token);
    if (g.taken <= g.kept) {  // a kept draft: its position's KV is written
      ++s->fed;
      RegisterBlocks(s);
    }
    s->stream->Push({t.token, t.logprob, t.top});
    if (s->generated.size() == 1) {
      if (observer_.first_token) {
        observer_.first_token(std::chrono::duration<double>(now - s->submitted).count());
      }
    } else if (observer_.inter_token) {
      observer_.inter_token(std::chrono::duration<double>(now - s->last_token).count());
    }
    s->last_token = now;
    if (observer_.generated) observer_.generated(1);
    if (const std::string end = EndReason(s, t.token); !end.empty()) {
      Retire(s, end, absl::OkStatus());
    } else if (s->offer) {
      Retire(s, "offered", absl::OkStatus());
    } else if (s->request.constraint != nullptr && g.taken == g.count) {
      // The grammar takes the step's tokens and computes the next mask while other steps run;
      // it may also say the output is complete (TakeMask ends the sequence then).
      StartMask(s, std::vector<int32_t>(s->generated.end() - g.count, s->generated.end()));
    }
  }
}

absl::flat_hash_map<Engine::Sequence*, std::vector<int32_t>> Engine::Propose(
    const MicroBatch& batch) {
  absl::flat_hash_map<Sequence*, std::vector<int32_t>> out;
  if (drafter_ == nullptr) return out;
  std::vector<Sequence*> seqs;
  std::vector<Drafter::Query> queries;
  for (Sequence* s : batch.seqs) {
    // A decode step of a sequence that speculates (under a grammar, the drafts it allows:
    // StartDraftMasks).
    if (s->fed + 1 != s->total() || !s->request.speculative || s->offer) {
      continue;
    }
    // Every draft kept and one token more stays within max_tokens and the context.
    const int64_t k =
        std::min({options_.speculative.tokens,
                  s->request.params.max_tokens - static_cast<int64_t>(s->generated.size()) - 1,
                  options_.max_context - s->total() - 1});
    if (k <= 0) continue;
    seqs.push_back(s);
    queries.push_back({s->id, s->request.prompt_ids, s->generated, k});
  }
  if (queries.empty()) return out;
  std::vector<std::vector<int32_t>> drafts = drafter_->Propose(queries);
  for (size_t i = 0; i < seqs.size() && i < drafts.size(); ++i) {
    // A drafter's answer is checked as a request's tokens would be.
    std::vector<int32_t>& d = drafts[i];
    if (static_cast<int64_t>(d.size()) > queries[i].k) d.resize(queries[i].k);
    if (std::any_of(d.begin(), d.end(),
                    [&](int32_t t) { return t < 0 || t >= options_.vocab_size; })) {
      continue;
    }
    if (!d.empty()) out[seqs[i]] = std::move(d);
  }
  return out;
}

std::string Engine::EndReason(const Sequence* s, int32_t token) const {
  const SamplingParams& p = s->request.params;
  const auto& stops = p.stop_token_ids;
  const auto& eos = options_.eos_token_ids;
  if (std::find(stops.begin(), stops.end(), token) != stops.end() ||
      (!p.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end())) {
    return "stop";
  }
  if (static_cast<int64_t>(s->generated.size()) >= p.max_tokens ||
      s->total() >= options_.max_context) {
    return "length";
  }
  return "";
}

absl::Status Engine::Loop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_ && ((waiting_.empty() && running_.empty()) || Clock::now() >= drain_until_)) {
        return absl::OkStatus();
      }
    }
    RETURN_IF_ERROR(OrderAdapters());
    for (int mb = 0; mb < static_cast<int>(mbs_.size()); ++mb) {
      if (mbs_[mb].in_flight) continue;
      StepDesc desc = BuildStep(mb);
      RETURN_IF_ERROR(replica_failure_);
      if (desc.chunks.empty() && desc.release.empty()) continue;  // frees cache even when idle
      RETURN_IF_ERROR(executor_->Issue(desc));
      mbs_[mb].in_flight = true;
      in_flight_.push_back(mb);
    }
    if (observer_.queue_depth) observer_.queue_depth(queue_depth());
    if (observer_.backlog) {
      int64_t prompt = 0;
      for (const auto& s : running_) {
        prompt += std::max<int64_t>(0, static_cast<int64_t>(s->request.prompt_ids.size()) - s->fed);
      }
      {
        absl::MutexLock lock(&mu_);
        for (const auto& s : waiting_) prompt += static_cast<int64_t>(s->request.prompt_ids.size());
      }
      observer_.backlog(static_cast<int>(running_.size()), prompt);
    }
    if (observer_.adapters) {
      std::set<int64_t> running, waiting;
      std::vector<std::string> running_names, waiting_names;
      {
        absl::MutexLock lock(&mu_);
        for (const auto& s : running_) {
          if (s->request.adapter >= 0) running.insert(s->request.adapter);
        }
        for (const auto& s : waiting_) {
          if (s->request.adapter >= 0) waiting.insert(s->request.adapter);
        }
        for (auto [ids, names] :
             {std::pair{&running, &running_names}, {&waiting, &waiting_names}}) {
          for (int64_t id : *ids) {
            if (const AdapterRegistry::Adapter* a = adapters_.Get(id)) names->push_back(a->name);
          }
        }
      }
      observer_.adapters(running_names, waiting_names);
    }
    if (in_flight_.empty()) {
      // Sequences running without a step wait for their masks (TakeMask): the loop wakes when
      // one is ready, or soon, to end those past their time.
      const bool masks_pending = !running_.empty();
      bool woken = masks_pending;
      {
        absl::MutexLock lock(&mu_);
        if (options_.exit_when_idle && waiting_.empty() && !masks_pending) {
          return absl::OkStatus();
        }
        if (!masks_pending && !waiting_.empty()) continue;  // admitted on the next pass
        if (!masks_pending && shutdown_) continue;          // drained
        const absl::Time deadline =
            absl::Now() +
            absl::FromChrono(masks_pending ? options_.mask_wait : options_.ping_every);
        const int64_t seen = masks_done_;
        while (!shutdown_ && waiting_.empty() && masks_done_ == seen && offers_released_.empty() &&
               lora_orders_.empty()) {
          if (wake_.WaitWithDeadline(&mu_, deadline)) break;
        }
        woken |=
            shutdown_ || !waiting_.empty() || !offers_released_.empty() || !lora_orders_.empty();
      }
      if (!woken) RETURN_IF_ERROR(executor_->Ping());  // idle: is the replica still there?
      continue;
    }
    const int mb = in_flight_.front();
    in_flight_.pop_front();
    ASSIGN_OR_RETURN(StepResult result, executor_->Collect());
    if (result.microbatch != mb) {
      return absl::DataLossError(absl::StrCat("step results out of order: expected micro-batch ",
                                              mb, ", got ", result.microbatch));
    }
    Accept(result);
  }
}

absl::StatusOr<int64_t> Engine::AdapterOf(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  const AdapterRegistry::Adapter* a = adapters_.Find(name);
  if (a == nullptr) {
    return absl::NotFoundError(absl::StrCat("the LoRA adapter '", name, "' is not loaded"));
  }
  return a->id;
}

absl::Status Engine::LoadAdapter(const std::string& name, const std::string& path) {
  {
    absl::MutexLock lock(&mu_);
    if (adapters_.slots() == 0) {
      return absl::FailedPreconditionError("this replica runs no LoRA adapters (maxLoras 0)");
    }
    if (const size_t kept = adapters_.adapters().size();
        adapters_.Find(name) == nullptr && kept >= static_cast<size_t>(options_.max_adapters)) {
      return absl::FailedPreconditionError(
          absl::StrCat("this replica keeps ", kept,
                       " LoRA adapters, its most (spec.lora.maxCpuLoras ", options_.max_adapters,
                       "; an unloaded one counts until its requests end): unload one "
                       "first"));
    }
    ASSIGN_OR_RETURN(const int64_t id, adapters_.Add(name, path));
    lora_orders_.push_back({LoraOrder::Op::kPrepare, id, path, -1});
  }
  wake_.SignalAll();
  return absl::OkStatus();
}

absl::Status Engine::UnloadAdapter(const std::string& name) {
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(adapters_.Remove(name));
  }
  wake_.SignalAll();
  return absl::OkStatus();
}

std::vector<std::string> Engine::adapter_names() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const AdapterRegistry::Adapter* a : adapters_.adapters()) {
    if (!a->removing) out.push_back(a->name);
  }
  return out;
}

std::vector<std::string> Engine::resident_adapters() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const AdapterRegistry::Adapter* a : adapters_.adapters()) {
    if (!a->removing && a->slot >= 0) out.push_back(a->name);
  }
  return out;
}

bool Engine::AdapterReady(const Sequence* s) const {
  if (s->request.adapter < 0) return true;
  const AdapterRegistry::Adapter* a = adapters_.Get(s->request.adapter);
  return a != nullptr && a->slot >= 0;
}

absl::Status Engine::OrderAdapters() {
  std::vector<LoraOrder> orders;
  {
    absl::MutexLock lock(&mu_);
    orders.swap(lora_orders_);
    for (const AdapterRegistry::Adapter& gone : adapters_.Reap()) {
      if (gone.slot >= 0) orders.push_back({LoraOrder::Op::kEvict, gone.id, "", gone.slot});
      orders.push_back({LoraOrder::Op::kForget, gone.id, "", -1});
    }
  }
  for (const LoraOrder& o : orders) {
    absl::Status result;
    RETURN_IF_ERROR(executor_->OrderLora(o, &result));
    if (!result.ok()) LogWarning("LoRA adapter ", o.id, ": ", result.message());
  }
  return absl::OkStatus();
}

void Engine::PlaceWaitingAdapters() {
  // The adapters without a slot of the first waiting sequences (as many as a batch holds).
  std::vector<int64_t> want;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& s : waiting_) {
      if (static_cast<int>(want.size()) >= options_.max_batch) break;
      const int64_t id = s->request.adapter;
      if (id >= 0 && !AdapterReady(s.get()) &&
          std::find(want.begin(), want.end(), id) == want.end()) {
        want.push_back(id);
      }
    }
  }
  for (int64_t id : want) {
    std::optional<AdapterRegistry::Placement> p;
    {
      absl::MutexLock lock(&mu_);
      if (adapters_.Get(id) != nullptr) p = adapters_.Place(id);
    }
    if (!p) continue;  // every slot's adapter runs (or the adapter is gone: its requests end)
    absl::Status result;
    replica_failure_ = executor_->OrderLora({LoraOrder::Op::kInstall, id, "", p->slot}, &result);
    if (!replica_failure_.ok()) return;
    absl::MutexLock lock(&mu_);
    if (result.ok()) {
      adapters_.Installed(id, p->slot);
      continue;
    }
    // The adapter cannot run here (a rank could not read it): its requests end with why.
    std::erase_if(waiting_, [&](const std::unique_ptr<Sequence>& s) {
      if (s->request.adapter != id) return false;
      if (s->request.constraint) s->request.constraint->Cancel();
      s->stream->Finish("", result);
      return true;
    });
    (void)adapters_.Remove(adapters_.Get(id)->name);
  }
  // Requests whose adapter was unloaded before they ran end: it is gone.
  absl::MutexLock lock(&mu_);
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Sequence* s = it->get();
    const int64_t id = s->request.adapter;
    const AdapterRegistry::Adapter* a = id >= 0 ? adapters_.Get(id) : nullptr;
    if (id < 0 || (a != nullptr && !(a->removing && a->slot < 0))) {
      ++it;
      continue;
    }
    if (s->request.constraint) s->request.constraint->Cancel();
    s->stream->Finish("", absl::NotFoundError("its LoRA adapter was unloaded before it ran"));
    it = waiting_.erase(it);
  }
}

void Engine::FailAll(const absl::Status& status) {
  for (const auto& s : running_) {
    if (s->request.constraint) s->request.constraint->Cancel();
    s->stream->Finish("", status);
  }
  running_.clear();
  running_count_.store(0);
  for (MicroBatch& mb : mbs_) mb.seqs.clear();
  absl::MutexLock lock(&mu_);
  accepting_ = false;
  for (const auto& s : waiting_) {
    if (s->request.constraint) s->request.constraint->Cancel();
    s->stream->Finish("", status);
  }
  waiting_.clear();
}

absl::Status Engine::Run() {
  absl::Status status = Loop();
  if (status.ok()) {
    // Let the steps in flight finish so every rank ends on a step boundary, then stop them.
    while (status.ok() && !in_flight_.empty()) {
      in_flight_.pop_front();
      status = executor_->Collect().status();
    }
  }
  if (status.ok()) status = executor_->Stop();
  if (!status.ok()) healthy_.store(false);
  FailAll(status.ok() ? absl::UnavailableError("the server is shutting down")
                      : absl::UnavailableError(
                            absl::StrCat("the model replica failed: ", status.message())));
  return status;
}

absl::StatusOr<std::vector<GenerationResult>> GenerateAll(
    StepExecutor* executor, EngineOptions options, const std::vector<GenerationRequest>& requests,
    EngineObserver observer) {
  options.max_queue = std::max<int>(options.max_queue, static_cast<int>(requests.size()));
  options.exit_when_idle = true;
  Engine engine(executor, options, std::move(observer));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto stream = engine.Submit(requests[i]);
    if (!stream.ok()) {
      const absl::Status bad(stream.status().code(),
                             absl::StrCat("request ", i, ": ", stream.status().message()));
      (void)executor->Stop();
      return bad;
    }
    streams.push_back(*std::move(stream));
  }
  RETURN_IF_ERROR(engine.Run());
  std::vector<GenerationResult> results(requests.size());
  for (size_t i = 0; i < streams.size(); ++i) {
    RequestStream::Update u = streams[i]->Next(std::chrono::milliseconds(0));
    for (RequestStream::Token& t : u.prompt) {
      results[i].prompt_logprobs.push_back({t.id, t.logprob, std::move(t.top)});
    }
    for (RequestStream::Token& t : u.tokens) {
      results[i].tokens.push_back(t.id);
      results[i].logprobs.push_back(t.logprob);
      if (requests[i].params.top_logprobs > 0) results[i].top_logprobs.push_back(std::move(t.top));
    }
    results[i].finish_reason = u.finish_reason;
  }
  return results;
}

}  // namespace shardserve
