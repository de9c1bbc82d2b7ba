#include "devtools/gen_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "common/text.h"
#include "common/thread_pool.h"
#include "devtools/corpus.h"
#include "model/safetensors.h"

namespace shardserve {
namespace {

using json = nlohmann::json;

constexpr uint64_t kSplitMixStep = 0x9e3779b97f4a7c15ull;

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += kSplitMixStep);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t HashName(const std::string& s, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// How a tensor is initialized: uniform in [center - scale, center + scale].
struct Init {
  float center;
  float scale;
};

struct Planned {
  TensorSpec spec;
  Init init{0.0f, 0.0f};
  bool linear = false;  // a projection an FP8 checkpoint stores in FP8
  int64_t block = 0;    // FP8: the block of the weight, or of the weight this scales
  std::string weight;   // FP8 scales: the weight's name
  std::vector<int64_t> weight_shape;
  // MXFP4: the blocks (or, with mxfp4_scales, the scales) of the fused expert tensor `weight`,
  // [E][in][out] as weight_shape says, quantized per 32 values of each [out] row's inputs.
  bool mxfp4 = false, mxfp4_scales = false;
};

// The values of the tensor named `name` (n of them), deterministic in the name and the seed.
std::vector<float> Values(const std::string& name, const Init& init, size_t n, uint64_t seed) {
  const uint64_t start = HashName(name, seed);
  std::vector<float> v(n);
  // The i-th value is the stream's i-th draw, wherever a chunk starts (SplitMix's state advances
  // by a constant a draw), so the values are the same on any number of cores.
  ThreadPool::EveryCore().ParallelFor(
      static_cast<int64_t>(n), 1 << 16, [&](int, int64_t begin, int64_t end) {
        uint64_t state = start + static_cast<uint64_t>(begin) * kSplitMixStep;
        for (int64_t i = begin; i < end; ++i) {
          const double u = static_cast<double>(SplitMix(state) >> 11) * 0x1.0p-53;  // [0, 1)
          v[i] = init.center + init.scale * static_cast<float>(2 * u - 1);
        }
      });
  return v;
}

// The FP8 scale of each block of a rows x cols matrix: its largest magnitude over E4M3's (448).
std::vector<float> BlockScales(const std::vector<float>& v, int64_t rows, int64_t cols,
                               int64_t block) {
  const int64_t gr = (rows + block - 1) / block, gc = (cols + block - 1) / block;
  std::vector<float> s(gr * gc, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float& m = s[(r / block) * gc + c / block];
      m = std::max(m, std::fabs(v[r * cols + c]));
    }
  }
  for (float& m : s) m = m > 0 ? m / 448.0f : 1.0f;
  return s;
}

// The square block an FP8 weight of `shape` is scaled in: the option's, or the whole matrix
// (GenModelOptions::kFp8PerTensor).
int64_t ScaleBlock(int64_t block, const std::vector<int64_t>& shape) {
  return block == GenModelOptions::kFp8PerTensor ? std::max(shape[0], shape[1]) : block;
}

// The E2M1 code nearest to v (ties to the even code's magnitude order: the lower).
uint8_t Fp4Code(float v) {
  static constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float a = std::fabs(v);
  int best = 0;
  for (int i = 1; i < 8; ++i) {
    if (std::fabs(kMagnitudes[i] - a) < std::fabs(kMagnitudes[best] - a)) best = i;
  }
  return static_cast<uint8_t>(best | (v < 0 && best > 0 ? 8 : 0));
}

// MXFP4 blocks and E8M0 scales of [E][in][out] values: each output row's inputs in blocks of 32,
// scaled by the power of two that brings the block's largest magnitude within E2M1's 6.
void FillMxfp4(const Planned& p, uint64_t seed, std::vector<uint8_t>& bytes) {
  const int64_t E = p.weight_shape[0], in = p.weight_shape[1], out = p.weight_shape[2];
  const std::vector<float> v = Values(p.weight, p.init, E * in * out, seed);
  const int64_t groups = in / 32;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t g = 0; g < groups; ++g) {
        auto at = [&](int64_t k) { return v[(e * in + g * 32 + k) * out + o]; };
        float amax = 0;
        for (int64_t k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(at(k)));
        const int exp = amax > 0 ? static_cast<int>(std::ceil(std::log2(amax / 6.0f))) : -127;
        const int s = std::clamp(exp + 127, 0, 254);
        const int64_t block = (e * out + o) * groups + g;
        if (p.mxfp4_scales) {
          bytes[block] = static_cast<uint8_t>(s);
          continue;
        }
        const float inv = std::ldexp(1.0f, 127 - s);
        for (int64_t k = 0; k < 32; k += 2) {
          bytes[block * 16 + k / 2] =
              static_cast<uint8_t>(Fp4Code(at(k) * inv) | (Fp4Code(at(k + 1) * inv) << 4));
        }
      }
    }
  }
}

void Fill(const Planned& p, uint64_t seed, std::vector<uint8_t>& bytes) {
  if (p.mxfp4) return FillMxfp4(p, seed, bytes);
  if (p.block != 0 && p.spec.dtype == DType::kF32) {  // the scales of an FP8 weight
    const std::vector<int64_t>& ws = p.weight_shape;
    const std::vector<float> s = BlockScales(Values(p.weight, p.init, ws[0] * ws[1], seed), ws[0],
                                             ws[1], ScaleBlock(p.block, ws));
    std::memcpy(bytes.data(), s.data(), 4 * s.size());
    return;
  }
  const size_t n = bytes.size() / DTypeSize(p.spec.dtype);
  const std::vector<float> v = Values(p.spec.name, p.init, n, seed);
  if (p.spec.dtype == DType::kF8E4M3) {
    const int64_t rows = p.spec.shape[0], cols = p.spec.shape[1];
    const int64_t block = ScaleBlock(p.block, p.spec.shape), gc = (cols + block - 1) / block;
    const std::vector<float> s = BlockScales(v, rows, cols, block);
    ThreadPool::EveryCore().ParallelFor(rows, 1, [&](int, int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          bytes[r * cols + c] = F32ToF8E4M3(v[r * cols + c] / s[(r / block) * gc + c / block]);
        }
      }
    });
    return;
  }
  ThreadPool::EveryCore().ParallelFor(
      static_cast<int64_t>(n), 1 << 16, [&](int, int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          switch (p.spec.dtype) {
            case DType::kF32:
              std::memcpy(bytes.data() + 4 * i, &v[i], 4);
              break;
            case DType::kF16: {
              const uint16_t h = F32ToF16(v[i]);
              std::memcpy(bytes.data() + 2 * i, &h, 2);
              break;
            }
            case DType::kBF16: {
              const uint16_t h = F32ToBf16(v[i]);
              std::memcpy(bytes.data() + 2 * i, &h, 2);
              break;
            }
            default:  // the plan holds element types only; quantized files go through gguf_convert
              break;
          }
        }
      });
}

// An FP8 checkpoint of the plan: each projection in F8_E4M3, its F32 scales right after it.
std::vector<Planned> AsFp8(std::vector<Planned> plain, int64_t block) {
  std::vector<Planned> out;
  for (Planned& p : plain) {
    if (!p.linear) {
      out.push_back(std::move(p));
      continue;
    }
    const std::vector<int64_t> shape = p.spec.shape;
    p.spec.dtype = DType::kF8E4M3;
    p.block = block;
    Planned scale;
    scale.spec = {p.spec.name + "_scale_inv", DType::kF32, {}};  // per tensor: a scalar
    if (block != GenModelOptions::kFp8PerTensor) {
      scale.spec.shape = {(shape[0] + block - 1) / block, (shape[1] + block - 1) / block};
    }
    scale.init = p.init;
    scale.block = block;
    scale.weight = p.spec.name;
    scale.weight_shape = shape;
    out.push_back(std::move(p));
    out.push_back(std::move(scale));
  }
  return out;
}

using AddTensor = std::function<void(const std::string&, std::vector<int64_t>, Init)>;

// One DeepSeek-V3 layer (transformers' names): multi-head latent attention, then a dense MLP
// (the first first_dense layers) or the routed experts with their score-correction bias (kept in
// F32, as transformers keeps it) and the shared experts.
void PlanDeepseekLayer(const GenModelOptions& o, const std::string& p, int64_t l,
                       const AddTensor& add) {
  const float sqrt3 = std::sqrt(3.0f);
  auto uniform_std = [&](double std) { return Init{0.0f, static_cast<float>(std * sqrt3)}; };
  const Init norm{1.0f, 0.1f};
  const int64_t H = o.hidden, Q = o.q_lora_rank, L = o.kv_lora_rank, R = o.rope_dim,
                qhd = o.nope_dim + R, nh = o.heads, I = o.moe_intermediate;
  const std::string a = p + "self_attn.";
  add(p + "input_layernorm.weight", {H}, norm);
  if (Q > 0) {
    add(a + "q_a_proj.weight", {Q, H}, uniform_std(1.0 / std::sqrt(H)));
    add(a + "q_a_layernorm.weight", {Q}, norm);
    add(a + "q_b_proj.weight", {nh * qhd, Q}, uniform_std(1.0 / std::sqrt(Q)));
  } else {
    add(a + "q_proj.weight", {nh * qhd, H}, uniform_std(1.0 / std::sqrt(H)));
  }
  add(a + "kv_a_proj_with_mqa.weight", {L + R, H}, uniform_std(1.0 / std::sqrt(H)));
  add(a + "kv_a_layernorm.weight", {L}, norm);
  add(a + "kv_b_proj.weight", {nh * (o.nope_dim + o.v_dim), L}, uniform_std(1.0 / std::sqrt(L)));
  add(a + "o_proj.weight", {H, nh * o.v_dim}, uniform_std(0.5 / std::sqrt(nh * o.v_dim)));
  add(p + "post_attention_layernorm.weight", {H}, norm);
  const std::string m = p + "mlp.";
  if (l < o.first_dense) {
    add(m + "gate_proj.weight", {o.intermediate, H}, uniform_std(1.0 / std::sqrt(H)));
    add(m + "up_proj.weight", {o.intermediate, H}, uniform_std(1.0 / std::sqrt(H)));
    add(m + "down_proj.weight", {H, o.intermediate}, uniform_std(0.5 / std::sqrt(o.intermediate)));
    return;
  }
  add(m + "gate.weight", {o.experts, H}, uniform_std(2.0 / std::sqrt(H)));
  add(m + "gate.e_score_correction_bias", {o.experts}, Init{0.0f, 0.1f});
  for (int64_t e = 0; e < o.experts; ++e) {
    const std::string ep = absl::StrCat(m, "experts.", e, ".");
    add(ep + "gate_proj.weight", {I, H}, uniform_std(1.0 / std::sqrt(H)));
    add(ep + "up_proj.weight", {I, H}, uniform_std(1.0 / std::sqrt(H)));
    add(ep + "down_proj.weight", {H, I}, uniform_std(0.5 / std::sqrt(I)));
  }
  if (o.shared_experts > 0) {
    const int64_t S = o.shared_experts * I;
    add(m + "shared_experts.gate_proj.weight", {S, H}, uniform_std(1.0 / std::sqrt(H)));
    add(m + "shared_experts.up_proj.weight", {S, H}, uniform_std(1.0 / std::sqrt(H)));
    add(m + "shared_experts.down_proj.weight", {H, S}, uniform_std(0.5 / std::sqrt(S)));
  }
}

// One gpt-oss layer (transformers' names): biased attention with a sink per head; the router with
// its bias; the experts fused, [E][in][out] with gate and up interleaved, and their biases.
void PlanGptOssLayer(const GenModelOptions& o, const std::string& p, int64_t head_dim,
                     const AddTensor& add) {
  const float sqrt3 = std::sqrt(3.0f);
  auto uniform_std = [&](double std) { return Init{0.0f, static_cast<float>(std * sqrt3)}; };
  const Init norm{1.0f, 0.1f}, bias{0.0f, 0.1f};
  const int64_t H = o.hidden, I = o.intermediate, E = o.experts, q = o.heads * head_dim,
                kv = o.kv_heads * head_dim;
  const std::string a = p + "self_attn.";
  add(p + "input_layernorm.weight", {H}, norm);
  add(a + "q_proj.weight", {q, H}, uniform_std(1.0 / std::sqrt(H)));
  add(a + "k_proj.weight", {kv, H}, uniform_std(1.0 / std::sqrt(H)));
  add(a + "v_proj.weight", {kv, H}, uniform_std(1.0 / std::sqrt(H)));
  add(a + "o_proj.weight", {H, q}, uniform_std(0.5 / std::sqrt(q)));
  add(a + "q_proj.bias", {q}, bias);
  add(a + "k_proj.bias", {kv}, bias);
  add(a + "v_proj.bias", {kv}, bias);
  add(a + "o_proj.bias", {H}, bias);
  add(a + "sinks", {o.heads}, Init{1.0f, 1.5f});
  add(p + "post_attention_layernorm.weight", {H}, norm);
  const std::string m = p + "mlp.";
  add(m + "router.weight", {E, H}, uniform_std(2.0 / std::sqrt(H)));
  add(m + "router.bias", {E}, bias);
  // Wide enough that some gates and ups pass the clamp.
  add(m + "experts.gate_up_proj", {E, H, 2 * I}, uniform_std(3.0 / std::sqrt(H)));
  add(m + "experts.gate_up_proj_bias", {E, 2 * I}, bias);
  add(m + "experts.down_proj", {E, I, H}, uniform_std(0.5 / std::sqrt(I)));
  add(m + "experts.down_proj_bias", {E, H}, bias);
}

// gpt-oss's checkpoint as it ships: each fused expert tensor ([E][in][out]) as MXFP4 blocks
// ([E][out][in / 32][16]) and scales ([E][out][in / 32]).
std::vector<Planned> AsMxfp4(std::vector<Planned> plain) {
  std::vector<Planned> out;
  for (Planned& p : plain) {
    const std::string& n = p.spec.name;
    if (!n.ends_with("experts.gate_up_proj") && !n.ends_with("experts.down_proj")) {
      out.push_back(std::move(p));
      continue;
    }
    const std::vector<int64_t> shape = p.spec.shape;  // E, in, out
    Planned blocks = p;
    blocks.mxfp4 = true;
    blocks.weight = n;
    blocks.weight_shape = shape;
    blocks.spec = {n + "_blocks", DType::kU8, {shape[0], shape[2], shape[1] / 32, 16}};
    Planned scales = blocks;
    scales.mxfp4_scales = true;
    scales.spec = {n + "_scales", DType::kU8, {shape[0], shape[2], shape[1] / 32}};
    out.push_back(std::move(blocks));
    out.push_back(std::move(scales));
  }
  return out;
}

std::vector<Planned> PlanTensors(const GenModelOptions& o, int64_t head_dim) {
  const float sqrt3 = std::sqrt(3.0f);
  auto uniform_std = [&](double std) { return Init{0.0f, static_cast<float>(std * sqrt3)}; };
  const int64_t H = o.hidden, I = o.intermediate, q = o.heads * head_dim,
                kv = o.kv_heads * head_dim;
  std::vector<Planned> t;
  AddTensor add = [&](const std::string& name, std::vector<int64_t> shape, Init init) {
    // The projections: the 2-D weights of attention and the MLPs, not the router's.
    const bool linear = shape.size() == 2 && (name.find("_proj") != std::string::npos ||
                                              name.find(".experts.") != std::string::npos);
    const bool f32 = name.find("e_score_correction_bias") != std::string::npos;
    Planned p;
    p.spec = {name, f32 ? DType::kF32 : o.dtype, std::move(shape)};
    p.init = init;
    p.linear = linear;
    t.push_back(std::move(p));
  };
  const Init norm{1.0f, 0.1f}, bias{0.0f, 0.1f};
  add("model.embed_tokens.weight", {o.vocab, H}, uniform_std(1.0));
  for (int64_t l = 0; l < o.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    if (o.arch == "deepseek_v3") {
      PlanDeepseekLayer(o, p, l, add);
      continue;
    }
    if (o.arch == "gpt_oss") {
      PlanGptOssLayer(o, p, head_dim, add);
      continue;
    }
    add(p + "input_layernorm.weight", {H}, norm);
    add(p + "self_attn.q_proj.weight", {q, H}, uniform_std(1.0 / std::sqrt(H)));
    add(p + "self_attn.k_proj.weight", {kv, H}, uniform_std(1.0 / std::sqrt(H)));
    add(p + "self_attn.v_proj.weight", {kv, H}, uniform_std(1.0 / std::sqrt(H)));
    add(p + "self_attn.o_proj.weight", {H, q}, uniform_std(0.5 / std::sqrt(q)));
    if (o.attention_bias || o.arch == "qwen2") {
      add(p + "self_attn.q_proj.bias", {q}, bias);
      add(p + "self_attn.k_proj.bias", {kv}, bias);
      add(p + "self_attn.v_proj.bias", {kv}, bias);
    }
    if (o.attention_bias && o.arch != "qwen2") add(p + "self_attn.o_proj.bias", {H}, bias);
    if (o.arch == "qwen3" || o.arch == "qwen3_moe") {
      add(p + "self_attn.q_norm.weight", {head_dim}, norm);
      add(p + "self_attn.k_norm.weight", {head_dim}, norm);
    }
    add(p + "post_attention_layernorm.weight", {H}, norm);
    if (o.arch == "mixtral" || o.arch == "qwen3_moe") {  // Qwen3-MoE: every layer sparse
      const bool mixtral = o.arch == "mixtral";
      const std::string m = p + (mixtral ? "block_sparse_moe." : "mlp.");
      add(m + "gate.weight", {o.experts, H}, uniform_std(2.0 / std::sqrt(H)));
      for (int64_t e = 0; e < o.experts; ++e) {
        const std::string ep = absl::StrCat(m, "experts.", e, ".");
        add(ep + (mixtral ? "w1" : "gate_proj") + ".weight", {I, H},
            uniform_std(1.0 / std::sqrt(H)));
        add(ep + (mixtral ? "w2" : "down_proj") + ".weight", {H, I},
            uniform_std(0.5 / std::sqrt(I)));
        add(ep + (mixtral ? "w3" : "up_proj") + ".weight", {I, H}, uniform_std(1.0 / std::sqrt(H)));
      }
    } else {
      add(p + "mlp.gate_proj.weight", {I, H}, uniform_std(1.0 / std::sqrt(H)));
      add(p + "mlp.up_proj.weight", {I, H}, uniform_std(1.0 / std::sqrt(H)));
      add(p + "mlp.down_proj.weight", {H, I}, uniform_std(0.5 / std::sqrt(I)));
    }
  }
  if (o.mtp) {  // DeepSeek-V3's multi-token-prediction layer, after the others (as it ships)
    const std::string p = absl::StrCat("model.layers.", o.layers, ".");
    PlanDeepseekLayer(o, p, o.layers, add);
    add(p + "enorm.weight", {H}, norm);
    add(p + "hnorm.weight", {H}, norm);
    add(p + "eh_proj.weight", {H, 2 * H}, uniform_std(1.0 / std::sqrt(2 * H)));
    add(p + "embed_tokens.weight", {o.vocab, H}, uniform_std(1.0));
    add(p + "shared_head.norm.weight", {H}, norm);
    add(p + "shared_head.head.weight", {o.vocab, H}, uniform_std(2.0 / std::sqrt(H)));
  }
  add("model.norm.weight", {H}, norm);
  if (!o.tie_embeddings) add("lm_head.weight", {o.vocab, H}, uniform_std(2.0 / std::sqrt(H)));
  return t;
}

// Chat templates in Hugging Face's Jinja form, one per common family (Llama 3, ChatML, Llama 2,
// Mistral), which shardserve renders as the model's own (tokenizer/chat_template.h) and
// transformers' apply_chat_template renders from the same models.
constexpr char kLlama3Template[] =
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}";
constexpr char kChatMlTemplate[] =
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
// ChatML as DeepSeek-R1's and Qwen3's thinking templates open the reply: inside a <think> block
// (the tokenizer then has <think> and </think>, not special, as theirs do); an earlier answer
// keeps only what follows its </think>.
constexpr char kChatMlThinkTemplate[] =
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' %}{% set content = content.split('</think>')[-1] %}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}"
    "{% endif %}";
// Qwen3's thinking switch: the model opens its own <think> block (the reply starts bare), unless
// chat_template_kwargs' enable_thinking is false, which writes an empty block into the prompt.
constexpr char kQwen3Template[] =
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' %}{% set content = content.split('</think>')[-1] | trim "
    "%}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}";
constexpr char kLlama2Template[] =
    "{% if messages[0]['role'] == 'system' %}{% set system = '<<SYS>>\n' + "
    "messages[0]['content'] + '\n<</SYS>>\n\n' %}{% set turns = messages[1:] %}{% else %}"
    "{% set system = '' %}{% set turns = messages %}{% endif %}{% for message in turns %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + (system if loop.first else '') "
    "+ message['content'] | trim + ' [/INST]' }}{% else %}{{ ' ' + message['content'] | trim + "
    "' ' + eos_token }}{% endif %}{% endfor %}";
constexpr char kMistralTemplate[] =
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}"
    "{% endif %}{{ bos_token }}{% for message in turns %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] | trim + '[/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}{% endfor %}";

// Mistral v0.3's shape with tools: the tools' JSON list in [AVAILABLE_TOOLS] before the last
// user turn, the assistant's calls as [TOOL_CALLS] and a JSON list of {"name", "arguments",
// "id"}, a tool's answer in [TOOL_RESULTS]; the bracketed markers are special tokens.
constexpr char kMistralToolsTemplate[] =
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set system = '' %}"
    "{%- set turns = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in turns %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if system and loop.index0 == ns.last_user %}"
    "{{- '[INST] ' + system + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '[TOOL_CALLS] [' }}{%- for c in message['tool_calls'] %}"
    "{{- {'name': c['function']['name'], 'arguments': c['function']['arguments'], "
    "'id': c['id']} | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] ' + ({'content': message['content'], 'call_id': "
    "message['tool_call_id']} | tojson) + '[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}";

// ChatML with tools in the Hermes format (as Qwen 2.5 / 3 and Hermes teach them): the tools'
// JSON schemas in the system turn, the assistant's calls as <tool_call>{"name": ...,
// "arguments": {...}}</tool_call>, the tools' answers in a user turn as <tool_response>s.
constexpr char kHermesTemplate[] =
    "{%- set sys = messages[0]['content'] if messages[0]['role'] == 'system' else "
    "'You are a helpful assistant.' %}"
    "{{- '<|im_start|>system\n' + sys }}"
    "{%- if tools %}"
    "{{- '\n\n# Tools\n\nYou may call functions to answer. Their signatures, one JSON object "
    "a line, within <tools></tools>:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each call, write a JSON object with the function name and its "
    "arguments within <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + fn.name + '\", \"arguments\": ' + "
    "fn.arguments | tojson + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}";

// DeepSeek-V3.1's shape with tools: the tools' JSON and the call format in the system text, the
// turns after <｜User｜> / <｜Assistant｜>, the assistant's calls as a <｜tool▁calls▁begin｜>
// section of NAME<｜tool▁sep｜>ARGUMENTS calls, a tool's answer between <｜tool▁output▁begin｜>
// and <｜tool▁output▁end｜>; the markers are special tokens.
constexpr char kDeepSeekToolsTemplate[] =
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- endif %}"
    "{%- if tools %}"
    "{{- '\n\n## Tools\nYou may call these functions:\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\n' }}{%- endfor %}"
    "{{- 'A call: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>"
    "tool_call_arguments<｜tool▁call▁end｜><｜tool▁calls▁end｜>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<｜Assistant｜>' + (message['content'] or '') + '<｜tool▁calls▁begin｜>' }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{- '<｜tool▁call▁begin｜>' + call['function']['name'] + '<｜tool▁sep｜>' + "
    "(args if args is string else args | tojson) + '<｜tool▁call▁end｜>' }}"
    "{%- endfor %}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}";

// gpt-oss's harmony in brief: a system message naming the channels, the tools as a TypeScript
// namespace in a developer message, each message <|start|>ROLE...<|message|>TEXT<|end|>, an
// assistant's call a commentary message to functions.NAME ending in <|call|>, a tool's answer a
// message from functions.NAME; the last assistant message ends in <|return|> (the end of a
// turn), and the reply opens with <|start|>assistant. The markers are special tokens.
constexpr char kHarmonyTemplate[] =
    "{{- '<|start|>system<|message|>You are a helpful assistant.\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.<|end|>' }}"
    "{%- if tools %}"
    "{{- '<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n' }}"
    "{%- for tool in tools %}"
    "{{- '\ntype ' + tool.function.name + ' = (_: ' + (tool.function.parameters | tojson) + "
    "') => any;\n' }}"
    "{%- endfor %}"
    "{{- '\n} // namespace functions<|end|>' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_call='') %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{{- '<|start|>developer<|message|># Instructions\n\n' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{%- set ns.last_call = call.function.name %}"
    "{%- set args = call.function.arguments %}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.function.name + "
    "' <|constrain|>json<|message|>' + (args if args is string else args | tojson) + "
    "'<|call|>' }}"
    "{%- endfor %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content }}"
    "{%- if loop.last and not add_generation_prompt %}{{- '<|return|>' }}"
    "{%- else %}{{- '<|end|>' }}{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + ns.last_call + ' to=assistant<|channel|>commentary<|message|>' "
    "+ message.content + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}";

// Llama 3 with tools in the form Llama 3.1-3.3 teach: the ipython environment in the system turn,
// the functions (JSON, indented) before the first user message's text, a call as a bare
// {"name": ..., "parameters": {...}} turn, a tool's answer in an ipython turn.
constexpr char kLlama3ToolsTemplate[] =
    "{{- bos_token }}"
    "{%- set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\n\n' }}{%- endif %}"
    "{{- sys + '<|eot_id|>' }}"
    "{%- set ns = namespace(first_user=true) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}"
    "{%- if tools and ns.first_user %}"
    "{{- 'Answer with a JSON function call when one of these functions helps, written as '"
    " + '{\"name\": function name, \"parameters\": its arguments}.\n\n' }}"
    "{%- for tool in tools %}{{- tool | tojson(indent=4) + '\n\n' }}{%- endfor %}"
    "{%- set ns.first_user = false %}"
    "{%- endif %}"
    "{{- message.content | trim + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- set fn = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"' + fn.name + "
    "'\", \"parameters\": ' + fn.arguments | tojson + '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content | trim + "
    "'<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | "
    "trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}";

std::string ChatTemplateFor(const GenModelOptions& o) {
  if (o.chat_template != "auto") return o.chat_template;
  if (o.arch == "qwen2" || o.arch == "qwen3" || o.arch == "qwen3_moe" || o.arch == "deepseek_v3") {
    return "chatml";
  }
  if (o.tokenizer == TokenizerStyle::kSentencePiece)
    return o.arch == "llama" ? "llama2" : "mistral";
  return o.arch == "llama" ? "llama3" : "mistral";
}

absl::Status WriteText(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(path.string(), ": write failed"));
  return absl::OkStatus();
}

}  // namespace

absl::Status GenModelOptions::Validate() const {
  if (arch != "llama" && arch != "mistral" && arch != "qwen2" && arch != "qwen3" &&
      arch != "qwen3_moe" && arch != "mixtral" && arch != "deepseek_v3" && arch != "gpt_oss") {
    return absl::InvalidArgumentError(
        absl::StrCat("--arch '", arch,
                     "' is not one of llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, "
                     "deepseek_v3, gpt_oss"));
  }
  if (arch == "gpt_oss" && (sliding_window <= 0 || !(swiglu_limit > 0))) {
    return absl::InvalidArgumentError("--sliding-window and --swiglu-limit must be positive");
  }
  if (mxfp4 && (arch != "gpt_oss" || hidden % 32 != 0 || intermediate % 32 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--mxfp4 is gpt_oss's, with --hidden (", hidden,
                                                   ") and --intermediate (", intermediate,
                                                   ") multiples of 32"));
  }
  if (mtp && arch != "deepseek_v3") {
    return absl::InvalidArgumentError("--mtp is deepseek_v3's (its multi-token-prediction layer)");
  }
  if (arch == "deepseek_v3") {
    for (auto [name, v] : {std::pair{"kv-lora", kv_lora_rank},
                           {"rope-dim", rope_dim},
                           {"nope-dim", nope_dim},
                           {"v-dim", v_dim},
                           {"groups", groups},
                           {"topk-groups", topk_groups},
                           {"moe-intermediate", moe_intermediate}}) {
      if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("--", name, " must be positive"));
    }
    if (q_lora_rank < 0 || shared_experts < 0 || first_dense < 0 || first_dense > layers) {
      return absl::InvalidArgumentError(
          "--q-lora and --shared-experts must not be negative, --first-dense in [0, --layers]");
    }
    if (rope_dim % 2 != 0 || experts % groups != 0 || topk_groups > groups ||
        top_k > topk_groups * (experts / groups)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rope-dim ", rope_dim, " must be even, --groups ", groups, " divide --experts ",
          experts, ", --topk-groups ", topk_groups, " at most --groups, and --top-k ", top_k,
          " at most the chosen groups' experts"));
    }
  }
  if (out_dir.empty()) return absl::InvalidArgumentError("--out is required");
  for (auto [name, v] : {std::pair{"layers", layers},
                         {"hidden", hidden},
                         {"intermediate", intermediate},
                         {"heads", heads},
                         {"kv-heads", kv_heads},
                         {"vocab", vocab},
                         {"max-position", max_position}}) {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("--", name, " must be positive"));
  }
  if (heads % kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-heads ", kv_heads, " must divide --heads ", heads));
  }
  if (head_dim == 0 && hidden % heads != 0 && arch != "deepseek_v3") {  // MLA sizes its heads
    return absl::InvalidArgumentError(
        absl::StrCat("--hidden ", hidden, " is not divisible by --heads ", heads));
  }
  if ((arch == "mixtral" || arch == "deepseek_v3" || arch == "gpt_oss") &&
      (experts <= 0 || top_k <= 0 || top_k > experts)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--top-k ", top_k, " must be between 1 and --experts ", experts));
  }
  if ((fp8_block < 0 && fp8_block != kFp8PerTensor) || fp8_block > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--fp8-block ", fp8_block, " is not a block size in [1, 4096] (or 0: none; tensor)"));
  }
  constexpr std::array<const char*, 13> kTemplates = {
      "auto",   "llama3",       "chatml",        "llama2",         "mistral",
      "hermes", "llama3-tools", "mistral-tools", "deepseek-tools", "chatml-think",
      "qwen3",  "harmony",      "none"};
  if (absl::c_find(kTemplates, chat_template) == kTemplates.end()) {
    return absl::InvalidArgumentError(absl::StrCat("--chat-template '", chat_template, "' is not ",
                                                   absl::StrJoin(kTemplates, ", ")));
  }
  if (!rope_scaling.empty() && rope_scaling != "llama3" && rope_scaling != "linear" &&
      rope_scaling != "yarn") {
    return absl::InvalidArgumentError(
        absl::StrCat("--rope-scaling '", rope_scaling, "' is not llama3, linear or yarn"));
  }
  return absl::OkStatus();
}

absl::Status GenerateModel(const GenModelOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  namespace fs = std::filesystem;
  const fs::path dir(o.out_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(o.out_dir, ": ", ec.message()));
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.find(".safetensors") != std::string::npos) fs::remove(entry.path());
  }
  const int64_t head_dim = o.head_dim > 0 ? o.head_dim : o.hidden / o.heads;

  std::string corpus(DefaultCorpus());
  if (!o.corpus_file.empty()) {
    ASSIGN_OR_RETURN(corpus, ReadFileToString(o.corpus_file));
  }
  const std::string chat = ChatTemplateFor(o);
  std::vector<std::string> chat_tokens =
      chat == "llama3"
          ? std::vector<std::string>{"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}
      : chat == "chatml" || chat == "chatml-think" || chat == "qwen3"
          ? std::vector<std::string>{"<|im_start|>", "<|im_end|>"}
      : chat == "mistral-tools"  ? std::vector<std::string>{"[INST]",
                                                            "[/INST]",
                                                            "[TOOL_CALLS]",
                                                            "[AVAILABLE_TOOLS]",
                                                            "[/AVAILABLE_TOOLS]",
                                                            "[TOOL_RESULTS]",
                                                            "[/TOOL_RESULTS]"}
      : chat == "deepseek-tools" ? std::vector<std::string>{"<｜User｜>",
                                                            "<｜Assistant｜>",
                                                            "<｜end▁of▁sentence｜>",
                                                            "<｜tool▁calls▁begin｜>",
                                                            "<｜tool▁calls▁end｜>",
                                                            "<｜tool▁call▁begin｜>",
                                                            "<｜tool▁call▁end｜>",
                                                            "<｜tool▁sep｜>",
                                                            "<｜tool▁output▁begin｜>",
                                                            "<｜tool▁output▁end｜>"}
      : chat == "harmony"
          ? std::vector<std::string>{"<|start|>",     "<|message|>", "<|end|>",   "<|channel|>",
                                     "<|constrain|>", "<|call|>",    "<|return|>"}
          : std::vector<std::string>{};
  const bool think_tokens = o.think_tokens || chat == "chatml-think" || chat == "qwen3";
  if (think_tokens) chat_tokens.insert(chat_tokens.end(), {"<think>", "</think>"});
  ASSIGN_OR_RETURN(TrainedTokenizer tok,
                   TrainBpeTokenizer(corpus, o.tokenizer, o.vocab, chat_tokens));
  if (think_tokens) {  // added, not special: decoded text keeps them
    json t = json::parse(tok.json);
    for (json& added : t["added_tokens"]) {
      if (added["content"] == "<think>" || added["content"] == "</think>") added["special"] = false;
    }
    tok.json = t.dump(2);
  }
  RETURN_IF_ERROR(WriteText(dir / "tokenizer.json", tok.json));
  json tok_config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                     {"bos_token", "<s>"},
                     {"eos_token", "</s>"},
                     {"add_bos_token", true},
                     {"model_max_length", o.max_position}};
  if (chat == "llama3") tok_config["chat_template"] = kLlama3Template;
  if (chat == "chatml") tok_config["chat_template"] = kChatMlTemplate;
  if (chat == "chatml-think") tok_config["chat_template"] = kChatMlThinkTemplate;
  if (chat == "qwen3") tok_config["chat_template"] = kQwen3Template;
  if (chat == "llama2") tok_config["chat_template"] = kLlama2Template;
  if (chat == "mistral") tok_config["chat_template"] = kMistralTemplate;
  if (chat == "hermes") tok_config["chat_template"] = kHermesTemplate;
  if (chat == "llama3-tools") tok_config["chat_template"] = kLlama3ToolsTemplate;
  if (chat == "mistral-tools") tok_config["chat_template"] = kMistralToolsTemplate;
  if (chat == "deepseek-tools") tok_config["chat_template"] = kDeepSeekToolsTemplate;
  if (chat == "harmony") tok_config["chat_template"] = kHarmonyTemplate;
  RETURN_IF_ERROR(WriteText(dir / "tokenizer_config.json", tok_config.dump(2)));

  const std::string arch_name = o.arch == "mixtral"       ? "MixtralForCausalLM"
                                : o.arch == "mistral"     ? "MistralForCausalLM"
                                : o.arch == "qwen2"       ? "Qwen2ForCausalLM"
                                : o.arch == "qwen3"       ? "Qwen3ForCausalLM"
                                : o.arch == "qwen3_moe"   ? "Qwen3MoeForCausalLM"
                                : o.arch == "deepseek_v3" ? "DeepseekV3ForCausalLM"
                                : o.arch == "gpt_oss"     ? "GptOssForCausalLM"
                                                          : "LlamaForCausalLM";
  json config = {{"architectures", {arch_name}},
                 {"model_type", o.arch},
                 {"hidden_size", o.hidden},
                 {"intermediate_size", o.intermediate},
                 {"num_hidden_layers", o.layers},
                 {"num_attention_heads", o.heads},
                 {"num_key_value_heads", o.kv_heads},
                 {"head_dim", head_dim},
                 {"vocab_size", o.vocab},
                 {"max_position_embeddings", o.max_position},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", o.arch == "mixtral" ? 1e6 : 10000.0},
                 {"hidden_act", "silu"},
                 {"tie_word_embeddings", o.tie_embeddings},
                 {"bos_token_id", tok.bos_id},
                 {"eos_token_id", tok.eos_id},
                 {"torch_dtype", o.dtype == DType::kF32   ? "float32"
                                 : o.dtype == DType::kF16 ? "float16"
                                                          : "bfloat16"},
                 {"initializer_range", 0.02},
                 {"use_cache", true}};
  if (o.arch == "llama") {
    config["attention_bias"] = o.attention_bias;
    config["mlp_bias"] = false;
  }
  if (o.arch == "qwen2" || o.arch == "qwen3" || o.arch == "qwen3_moe") {
    config["use_sliding_window"] = false;
  }
  if (o.arch == "qwen3" || o.arch == "qwen3_moe") config["attention_bias"] = o.attention_bias;
  if (o.arch == "qwen3_moe") {
    config["num_experts"] = o.experts;
    config["num_experts_per_tok"] = o.top_k;
    config["moe_intermediate_size"] = o.intermediate;
    config["norm_topk_prob"] = o.norm_topk_prob;
    config["decoder_sparse_step"] = 1;
    config["mlp_only_layers"] = json::array();
    config["router_aux_loss_coef"] = 0.0;
  }
  if (o.arch == "mistral") config["sliding_window"] = 4096;
  if (o.arch == "mixtral") {
    config["num_local_experts"] = o.experts;
    config["num_experts_per_tok"] = o.top_k;
    config["sliding_window"] = nullptr;
    config["router_aux_loss_coef"] = 0.0;
  }
  if (o.arch == "deepseek_v3") {  // DeepseekV3Config's fields
    config.erase("head_dim");
    config["num_key_value_heads"] = o.heads;
    config["moe_intermediate_size"] = o.moe_intermediate;
    config["n_routed_experts"] = o.experts;
    config["num_experts_per_tok"] = o.top_k;
    config["n_shared_experts"] = o.shared_experts;
    config["routed_scaling_factor"] = 2.5;
    config["kv_lora_rank"] = o.kv_lora_rank;
    config["q_lora_rank"] = o.q_lora_rank > 0 ? json(o.q_lora_rank) : json(nullptr);
    config["qk_rope_head_dim"] = o.rope_dim;
    config["qk_nope_head_dim"] = o.nope_dim;
    config["v_head_dim"] = o.v_dim;
    config["n_group"] = o.groups;
    config["topk_group"] = o.topk_groups;
    config["first_k_dense_replace"] = o.first_dense;
    config["norm_topk_prob"] = o.norm_topk_prob;
    config["rope_interleave"] = true;
    config["attention_bias"] = false;
    config["topk_method"] = "noaux_tc";
    config["scoring_func"] = "sigmoid";
    config["num_nextn_predict_layers"] = o.mtp ? 1 : 0;
  }
  if (o.arch == "gpt_oss") {  // GptOssConfig's fields
    config["num_local_experts"] = o.experts;
    config["num_experts_per_tok"] = o.top_k;
    config["experts_per_token"] = o.top_k;
    config["swiglu_limit"] = o.swiglu_limit;
    config["sliding_window"] = o.sliding_window;
    json types = json::array();
    for (int64_t l = 0; l < o.layers; ++l) {
      types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
    }
    config["layer_types"] = types;
    config["attention_bias"] = true;
    config["router_aux_loss_coef"] = 0.0;
  }
  if (o.mxfp4) {  // as gpt-oss's checkpoints have it
    config["quantization_config"] = {{"quant_method", "mxfp4"},
                                     {"modules_to_not_convert",
                                      {"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"}}};
  }
  if (o.fp8_block != 0) {  // as Hugging Face's FineGrainedFP8Config writes it
    config["quantization_config"] = {{"quant_method", "fp8"},
                                     {"fmt", "e4m3"},
                                     {"activation_scheme", "dynamic"},
                                     {"weight_block_size", {o.fp8_block, o.fp8_block}}};
    if (o.fp8_block == GenModelOptions::kFp8PerTensor) {
      config["quantization_config"]["weight_block_size"] = nullptr;
    }
  }
  if (o.rope_scaling == "llama3") {
    config["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", 8.0},
                              {"low_freq_factor", 1.0},
                              {"high_freq_factor", 4.0},
                              {"original_max_position_embeddings", 64}};
  } else if (o.rope_scaling == "linear") {
    config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  } else if (o.rope_scaling == "yarn") {
    // DeepSeek-V3's shape of it (mscale = mscale_all_dim: the rotated dims unscaled, the softmax
    // scale corrected); elsewhere the attention factor from the factor alone.
    config["rope_scaling"] = {{"rope_type", "yarn"},
                              {"factor", 4.0},
                              {"original_max_position_embeddings", 64},
                              {"beta_fast", 32},
                              {"beta_slow", 1}};
    if (o.arch == "deepseek_v3") {
      config["rope_scaling"]["mscale"] = 1.0;
      config["rope_scaling"]["mscale_all_dim"] = 1.0;
    }
    if (o.arch == "gpt_oss") config["rope_scaling"]["truncate"] = false;  // as gpt-oss sets it
  }
  RETURN_IF_ERROR(WriteText(dir / "config.json", config.dump(2)));
  json gen_config = {{"bos_token_id", tok.bos_id}, {"eos_token_id", tok.eos_id}};
  if (chat == "harmony") {  // as gpt-oss's: the end of text and <|return|> (not <|call|>)
    gen_config["eos_token_id"] = json::array({tok.eos_id});
    const json t = json::parse(tok.json);
    for (const json& added : t["added_tokens"]) {
      if (added["content"] == "<|return|>") gen_config["eos_token_id"].push_back(added["id"]);
    }
  }
  RETURN_IF_ERROR(WriteText(dir / "generation_config.json", gen_config.dump(2)));

  std::vector<Planned> planned = PlanTensors(o, head_dim);
  if (o.fp8_block != 0) planned = AsFp8(std::move(planned), o.fp8_block);
  if (o.mxfp4) planned = AsMxfp4(std::move(planned));
  // Group tensors into shards of about shard_bytes (one file when shard_bytes == 0).
  std::vector<std::vector<size_t>> shards(1);
  size_t current = 0, total = 0;
  for (size_t i = 0; i < planned.size(); ++i) {
    const size_t n = planned[i].spec.nbytes();
    if (o.shard_bytes > 0 && current > 0 && current + n > static_cast<size_t>(o.shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += n;
    total += n;
  }
  const std::map<std::string, std::string> meta{{"format", "pt"}};
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = shards.size() == 1 ? "model.safetensors"
                                                : absl::StrFormat("model-%05d-of-%05d.safetensors",
                                                                  s + 1, shards.size());
    std::vector<TensorSpec> specs;
    for (size_t i : shards[s]) {
      specs.push_back(planned[i].spec);
      weight_map[planned[i].spec.name] = file;
    }
    RETURN_IF_ERROR(WriteSafetensors(
        (dir / file).string(), specs,
        [&](size_t k, std::vector<uint8_t>& bytes) { Fill(planned[shards[s][k]], o.seed, bytes); },
        meta));
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    RETURN_IF_ERROR(WriteText(dir / "model.safetensors.index.json", index.dump(2)));
  } else {
    fs::remove(dir / "model.safetensors.index.json");
  }
  return absl::OkStatus();
}

}  // namespace shardserve
