// PONTE_IB_HCA: which verbs devices and ports ponte uses, in NCCL_IB_HCA's syntax.
// "mlx5_0:1,mlx5_1" (prefix match), "=mlx5_0" (exact names), "^mlx5_2" (exclude), "^=mlx5_2".
#pragma once

#include <string>
#include <vector>

#include "core/status.h"

namespace ponte::verbs {

class HcaFilter {
 public:
  struct Entry {
    std::string name;  // device name, or a prefix of it unless exact
    int port = -1;     // -1: every port
  };

  // Empty or all-blank text accepts everything. kInvalidArgument on a bad entry (empty name,
  // non-numeric / out-of-range port, a name longer than a device name can be).
  static Result<HcaFilter> parse(const std::string& text);

  // Whether the filter keeps port `port` of device `device`.
  bool accepts(const std::string& device, int port) const;

  bool exclude() const { return exclude_; }
  bool exact() const { return exact_; }
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  bool exclude_ = false;
  bool exact_ = false;
  std::vector<Entry> entries_;
};

}  // namespace ponte::verbs
