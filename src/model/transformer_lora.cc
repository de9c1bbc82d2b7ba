// LoRA adapters in the transformer (model/transformer.h): each slot's factors, sliced for this
// rank, in one backend buffer; per layer and projection the table of every slot's factors that
// Backend::LoraAdd gathers from, row by row (Punica's BGMV), so that sequences of different
// adapters and of the base share a step.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "model/transformer.h"

namespace shardserve {

Transformer::LoraShare Transformer::LoraShareOf(LoraTarget target) const {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, hd = c.head_dim;
  const int64_t T = options_.tp_size, t = options_.tp_rank;
  const int64_t q0 = t * heads_ * hd, q1 = q0 + heads_ * hd;
  const int64_t k0 = kv_head_begin_ * hd, k1 = k0 + kv_heads_ * hd;
  const int64_t I = c.intermediate_size, i0 = t * I / T, i1 = (t + 1) * I / T;
  switch (target) {
    case LoraTarget::kQ:
      return {H, q1 - q0, q0, q1, false};
    case LoraTarget::kK:
    case LoraTarget::kV:
      return {H, k1 - k0, k0, k1, false};
    case LoraTarget::kO:
      return {q1 - q0, H, q0, q1, true};
    case LoraTarget::kGate:
    case LoraTarget::kUp:
      return {H, i1 - i0, i0, i1, false};
    case LoraTarget::kDown:
      return {i1 - i0, H, i0, i1, true};
  }
  return {};
}

absl::Status Transformer::InitLora() {
  const int slots = options_.lora_slots;
  if (slots < 0 || slots > 1024 || options_.lora_max_rank < 0 || options_.lora_max_rank > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("LoRA: ", slots, " slots of rank up to ",
                                                   options_.lora_max_rank,
                                                   " (at most 1024 slots of rank 4096)"));
  }
  if (slots == 0) return absl::OkStatus();
  lora_mem_.resize(slots);
  lora_.resize(layers_.size());
  for (auto& layer : lora_) {
    for (int ti = 0; ti < kLoraTargets; ++ti) {
      LoraProjection& p = layer[ti];
      const LoraShare share = LoraShareOf(static_cast<LoraTarget>(ti));
      p.a.assign(slots, nullptr);
      p.bt.assign(slots, nullptr);
      p.rank.assign(slots, 0);
      p.scale.assign(slots, 0.0f);
      for (auto* b : {&p.a_mem, &p.b_mem, &p.rank_mem, &p.scale_mem}) *b = backend_->NewBuffer();
      p.table.slots = slots;
      p.table.in = share.in;
      p.table.out = share.out;
      p.table.max_rank = options_.lora_max_rank;
      RETURN_IF_ERROR(PublishLora(p));
    }
  }
  return absl::OkStatus();
}

absl::Status Transformer::PublishLora(LoraProjection& p) {
  RETURN_IF_ERROR(Put(*p.a_mem, p.a));
  RETURN_IF_ERROR(Put(*p.b_mem, p.bt));
  RETURN_IF_ERROR(Put(*p.rank_mem, p.rank));
  RETURN_IF_ERROR(Put(*p.scale_mem, p.scale));
  p.table.a = p.a_mem->as<const float*>();
  p.table.bt = p.b_mem->as<const float*>();
  p.table.rank = p.rank_mem->as<int32_t>();
  p.table.scale = p.scale_mem->as<float>();
  return absl::OkStatus();
}

absl::StatusOr<PreparedLora> Transformer::PrepareLora(const LoraAdapter& adapter) const {
  // Check every module, and lay out this rank's share of those of its stage.
  PreparedLora out;
  size_t floats = 0;
  for (const LoraModule& m : adapter.modules) {
    if (m.rank < 1 || m.rank > options_.lora_max_rank) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", m.layer, " ", LoraTargetName(m.target), ": rank ", m.rank,
                       " is over this replica's largest LoRA rank ", options_.lora_max_rank));
    }
    if (m.layer < 0 || m.layer >= config_.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("a LoRA module of layer ", m.layer, " in a ",
                                                     config_.num_layers, "-layer model"));
    }
    if (m.layer < layer_begin_ || m.layer >= layer_end_) continue;
    const Layer& L = layers_[m.layer - layer_begin_];
    const LoraShare share = LoraShareOf(m.target);
    const bool mlp = m.target == LoraTarget::kGate || m.target == LoraTarget::kUp ||
                     m.target == LoraTarget::kDown;
    const int64_t full_in = share.slices_a ? m.in : share.in;
    const int64_t full_out = share.slices_a ? share.out : m.out;
    if (config_.mla || (mlp && L.sparse) || m.in != full_in || m.out != full_out ||
        static_cast<int64_t>(m.a.size()) != m.rank * m.in ||
        static_cast<int64_t>(m.b.size()) != m.out * m.rank ||
        share.end > (share.slices_a ? m.in : m.out)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", m.layer, " ", LoraTargetName(m.target), ": a LoRA update of ",
                       m.in, " -> ", m.out, " does not fit this model's projection"));
    }
    out.pieces.push_back({m.layer - layer_begin_, m.target, m.rank, m.scale, floats,
                          floats + static_cast<size_t>(m.rank * share.in)});
    floats += static_cast<size_t>(m.rank * (share.in + share.out));
  }
  float* laid = nullptr;
  if (backend_->host_memory()) {
    out.mem = backend_->NewBuffer();
    RETURN_IF_ERROR(out.mem->Reserve(std::max<size_t>(floats, 1) * sizeof(float)));
    laid = out.mem->as<float>();
  } else {
    out.host.resize(std::max<size_t>(floats, 1));
    laid = out.host.data();
  }
  size_t k = 0;
  for (const LoraModule& m : adapter.modules) {
    if (m.layer < layer_begin_ || m.layer >= layer_end_) continue;
    const PreparedLora::Piece& p = out.pieces[k++];
    const LoraShare share = LoraShareOf(m.target);
    float* a = laid + p.a_at;
    float* b = laid + p.b_at;
    // Row-parallel: A's columns of this rank's inputs, all of B; column-parallel: all of A, B's
    // rows of this rank's outputs. B transposed ([rank][out], as LoraTable holds it).
    const int64_t a0 = share.slices_a ? share.begin : 0;
    const int64_t b0 = share.slices_a ? 0 : share.begin;
    for (int64_t j = 0; j < m.rank; ++j) {
      std::copy_n(m.a.data() + j * m.in + a0, share.in, a + j * share.in);
      for (int64_t n = 0; n < share.out; ++n) b[j * share.out + n] = m.b[(b0 + n) * m.rank + j];
    }
  }
  return out;
}

absl::Status Transformer::InstallLora(int slot, const PreparedLora& prepared) {
  RETURN_IF_ERROR(UnloadLora(slot));
  std::shared_ptr<const Buffer> mem = prepared.mem;  // laid out in backend memory already
  if (mem == nullptr) {
    std::shared_ptr<Buffer> copy = backend_->NewBuffer();
    const size_t bytes = prepared.host.size() * sizeof(float);
    RETURN_IF_ERROR(copy->Reserve(bytes));
    RETURN_IF_ERROR(backend_->CopyFromHost(copy->data(), prepared.host.data(), bytes));
    mem = std::move(copy);
  }
  const float* base = mem->as<const float>();
  lora_mem_[slot] = std::move(mem);
  std::vector<std::array<bool, kLoraTargets>> touched(lora_.size());
  for (const PreparedLora::Piece& p : prepared.pieces) {
    const int ti = static_cast<int>(p.target);
    if (p.layer < 0 || p.layer >= static_cast<int64_t>(lora_.size())) {
      return absl::InvalidArgumentError("a prepared LoRA adapter of another stage");
    }
    LoraProjection& proj = lora_[p.layer][ti];
    proj.a[slot] = base + p.a_at;
    proj.bt[slot] = base + p.b_at;
    proj.rank[slot] = static_cast<int32_t>(p.rank);
    proj.scale[slot] = p.scale;
    touched[p.layer][ti] = true;
  }
  for (size_t li = 0; li < lora_.size(); ++li) {
    for (int ti = 0; ti < kLoraTargets; ++ti) {
      if (touched[li][ti]) RETURN_IF_ERROR(PublishLora(lora_[li][ti]));
    }
  }
  return backend_->Synchronize();
}

absl::Status Transformer::LoadLora(int slot, const LoraAdapter& adapter) {
  if (slot < 0 || slot >= options_.lora_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoRA slot ", slot, " is outside this replica's ", options_.lora_slots));
  }
  ASSIGN_OR_RETURN(const PreparedLora prepared, PrepareLora(adapter));
  return InstallLora(slot, prepared);
}

absl::Status Transformer::UnloadLora(int slot) {
  if (slot < 0 || slot >= options_.lora_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoRA slot ", slot, " is outside this replica's ", options_.lora_slots));
  }
  if (lora_mem_[slot] == nullptr) return absl::OkStatus();
  for (auto& layer : lora_) {
    for (LoraProjection& p : layer) {
      if (p.rank[slot] == 0) continue;
      p.a[slot] = p.bt[slot] = nullptr;
      p.rank[slot] = 0;
      p.scale[slot] = 0;
      RETURN_IF_ERROR(PublishLora(p));
    }
  }
  // The tables no longer name the memory; work queued before may still read it.
  RETURN_IF_ERROR(backend_->Synchronize());
  lora_mem_[slot].reset();
  return absl::OkStatus();
}

size_t Transformer::lora_bytes(int slot) const {
  if (slot < 0 || slot >= static_cast<int>(lora_mem_.size()) || !lora_mem_[slot]) return 0;
  return lora_mem_[slot]->size();
}

absl::Status Transformer::ApplyLora(int64_t li, LoraTarget target, const Buffer& x, Buffer& y,
                                    int64_t rows) {
  if (!lora_batch_) return absl::OkStatus();
  const LoraTable& t = lora_[li][static_cast<int>(target)].table;
  return backend_->LoraAdd(t, buf_.lora_rows->as<int32_t>(), rows, x.as<float>(), y.as<float>(),
                           buf_.lora_u->as<float>());
}

}  // namespace shardserve
