#pragma once
// The op conformance suite of the backend seam (backend/backend.h): every op of every backend
// against plain host arithmetic written here, in double precision. backend_ops_test.cc holds the
// tests; each test binary instantiates them for the backends it has (unit_tests: the CPU;
// cuda_tests: the GPU, skipped without one).
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace shardserve::testing {

struct BackendCase {
  std::string name;
  // The backend, or null where this machine cannot run it (the tests then skip).
  std::function<std::unique_ptr<Backend>()> make;
  // The relative error the backend's matrix products give the activations they multiply weights
  // of a dtype by (null: none beyond F32's; the CPU at kAvx512Bf16 rounds them to BF16 for BF16
  // weights), asked once the backend is made.
  std::function<double(DType)> activation_rounding;
  // The steps of the integer rounding the quantized decode products (up to 8 rows) give the
  // activations they multiply blocks of a dtype by (null: the CPU's int16, 32767; the GPU's dp4a
  // GEMV rounds them to int8 per 32, 254), asked once the backend is made.
  std::function<double(DType)> quantized_input_steps;
};

class BackendOpsTest : public ::testing::TestWithParam<BackendCase> {
 protected:
  void SetUp() override;
  // The case's activation_rounding for weights of `dtype` (0 without one).
  double ActivationRounding(DType dtype) const;
  // The case's quantized_input_steps for blocks of `dtype` (32767 without one).
  double QuantizedInputSteps(DType dtype) const;
  std::unique_ptr<Backend> be_;
};

// n uniform floats in [lo, hi) from `seed`.
inline std::vector<float> Random(size_t n, uint32_t seed, float lo = -1, float hi = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

inline std::string BackendCaseName(const ::testing::TestParamInfo<BackendCase>& info) {
  return info.param.name;
}

}  // namespace shardserve::testing
