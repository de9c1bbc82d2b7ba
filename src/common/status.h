#pragma once
// Status helpers shared by every module: RETURN_IF_ERROR / ASSIGN_OR_RETURN.
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SS_CONCAT_INNER_(a, b) a##b
#define SS_CONCAT_(a, b) SS_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                \
  do {                                       \
    ::absl::Status ss_status_ = (expr);      \
    if (!ss_status_.ok()) return ss_status_; \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, expr) \
  SS_ASSIGN_OR_RETURN_IMPL_(SS_CONCAT_(ss_statusor_, __LINE__), lhs, expr)
#define SS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return std::move(tmp).status();  \
  lhs = std::move(tmp).value()
