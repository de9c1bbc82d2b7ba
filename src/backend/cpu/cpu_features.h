#pragma once
// The instruction sets the CPU backend's kernels need, checked at run time, and the kernel level
// chosen for this machine. On x86-64 the kernels (backend/cpu: cpu_backend, kernels, quant,
// sampling) are compiled for x86-64-v3 (AVX2, FMA, F16C); everything else is built for the
// baseline, so a CPU without them gets this error from the model loader instead of an illegal
// instruction. Any other CPU (ARM) builds the portable kernels (kernels_portable.cc,
// quant_portable.cc: SHARDSERVE_PORTABLE_KERNELS, which an x86-64 build can choose too), one
// level, kPortable, that runs on every CPU the compiler targets (ARM: NEON). Wider
// kernels (AVX-512: kernels_avx512.cc; AVX512-BF16: kernels_avx512bf16.cc) are built alongside in
// their own sources and run where the CPU has them (KernelLevel), unless the worker contract's
// SHARDSERVE_CPU_KERNELS (api/worker_env.h) asks for a lower level: whoever runs the model sets it
// (SetKernelLevel).
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardserve::cpu {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  // AVX-512 foundation with its byte/word and vector-length extensions (KernelLevel::kAvx512),
  // its BF16 dot products (kAvx512Bf16) and VNNI (reported); AMX's tiles with their BF16 dot
  // products (kAvx512Bf16's prefill, where the kernel grants the tiles' state: avx512::UsesAmx)
  // and their int8 dot products (kAvx512Int8's prefill, likewise).
  bool avx512 = false, avx512_bf16 = false, avx512_vnni = false, amx_bf16 = false, amx_int8 = false;
  // AVX-VNNI: VNNI's dot products on 256-bit vectors in a VEX encoding, on CPUs with AVX2 that may
  // lack AVX-512 (Alder Lake and later cores, Zen 5): kAvx2's int16 dot products (UsesVnni).
  bool avx_vnni = false;
  // ARM (reported): Advanced SIMD (NEON) and its dot product extension.
  bool neon = false, dotprod = false;
  // An AMD CPU (CPUID's vendor): its cores run AVX512-BF16's dot products at twice the width of
  // their F32 FMAs (Zen 4 splits a 512-bit FMA in two; Zen 5's BF16 pipes double its FMAs'),
  // where Intel's run them on one port against the FMAs' two (auto's choice, ChooseKernelLevel).
  bool amd = false;
  static CpuFeatures Detect();  // this machine's, from CPUID or (ARM) the kernel's HWCAP
};

// FailedPrecondition naming each missing feature when `have` cannot run the kernels (the portable
// kernels run on any CPU).
absl::Status CheckCpu(const CpuFeatures& have = CpuFeatures::Detect());

// The kernels the CPU backend runs, narrowest first: AVX2; AVX-512's wider tiles, bit for bit
// AVX2's results; and with them BF16 weights multiplied by AVX512-BF16's dot products against
// activations rounded to BF16 (kernels_avx512.h), as llama.cpp does: another arithmetic, auto's
// only where it outruns the F32 FMAs; or (kAvx512Int8) AVX-512's kernels with the block-quantized
// types' decode (quant.h's DecodesOnInt8) and prefill on activations quantized to int8 per
// block, multiplied by AVX512-VNNI's vpdpbusd (llama.cpp's arithmetic for them), never auto's: a
// block's activations lose 8 bits more than the int16 path's. A portable build has kPortable
// alone; an x86-64 build the other four.
enum class KernelLevel { kAvx2, kAvx512, kAvx512Bf16, kAvx512Int8, kPortable };
const char* KernelLevelName(KernelLevel level);
// The level `asked` names (SHARDSERVE_CPU_KERNELS: auto or empty, the fastest `have` runs:
// avx512bf16 on an AMD CPU with AVX512-BF16 and without AMX (the BF16 dot products twice the F32
// FMAs' width, BF16 weights kept as BF16X, whose prefill and decode give the same bits), else
// avx512 or avx2 (F32 arithmetic), or portable in a portable build; avx2; avx512; avx512bf16;
// avx512int8; portable), refused naming the variable when `have` or this build lacks it or it
// names no level.
absl::StatusOr<KernelLevel> ChooseKernelLevel(const CpuFeatures& have, std::string_view asked);
// The level the kernels run in this process: auto's unless set.
KernelLevel ActiveKernelLevel();
// Runs `level`'s kernels from now on (a rank, as its contract says; tests and benchmarks compare
// the levels a CPU has).
void SetKernelLevel(KernelLevel level);
// Whether the active level's int16 dot products of the quantized types (decode, prefill) take
// VNNI's vpdpwssd, one instruction for madd and add, the same sums: AVX512-VNNI's at the AVX-512
// levels, AVX-VNNI's at kAvx2, where the CPU has it (never in a portable build); UseVnni(false)
// turns both off (tests and benchmarks compare the two).
bool UsesVnni();
void UseVnni(bool on);
// Whether the quantized types' decode loops prefetch their rows ahead in software (quant_decode.h):
// not on AMD's cores with AVX-512 (Zen 4, Zen 5), whose hardware prefetchers keep one thread's
// read of the rows going, where the prefetches only took load slots (TinyLlama Q4_K_M's decode
// at one thread 10-13 % faster without them, in huge pages and in 4 KiB pages alike); elsewhere
// yes (the AVX2 machine they were measured on read a third less without them). UseDecodePrefetch
// overrides it (benchmarks compare the two); the results are the same bits either way.
bool DecodePrefetches();
void UseDecodePrefetch(bool on);
// SetKernelLevel of ChooseKernelLevel(this CPU, asked).
absl::Status UseKernelLevel(std::string_view asked);
// "avx512 (AVX-512 BF16, VNNI present)", "portable (NEON, dot product present)": the active level
// and what else the CPU offers, for the log and the metrics.
std::string DescribeKernels();

}  // namespace shardserve::cpu
