#pragma once
// `shardserve bench informer`: the Kubernetes client against a real apiserver — time to create
// N pods, time for an informer to list and watch them, its memory per cached pod, and watch
// events handled per second.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

absl::Status RunInformerBench(const std::vector<std::string>& argv);
inline constexpr char kInformerBenchUsage[] =
    "--kubeconfig PATH [--pods N --updates N --namespace NS]\n(the operator informer against an "
    "apiserver)";

}  // namespace shardserve
