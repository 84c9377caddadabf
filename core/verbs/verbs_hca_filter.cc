// PONTE_IB_HCA parsing and matching.
#include "core/verbs/verbs_hca_filter.h"

#include <cctype>

namespace ponte::verbs {

namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

constexpr size_t kMaxDeviceName = 63;  // IBV_SYSFS_NAME_MAX - 1

}  // namespace

Result<HcaFilter> HcaFilter::parse(const std::string& text) {
  HcaFilter f;
  std::string s = trim(text);
  if (s.empty()) return f;
  size_t pos = 0;
  if (s[pos] == '^') {
    f.exclude_ = true;
    ++pos;
  }
  if (pos < s.size() && s[pos] == '=') {
    f.exact_ = true;
    ++pos;
  }
  std::string body = s.substr(pos);
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    if (comma == std::string::npos) comma = body.size();
    std::string item = trim(body.substr(start, comma - start));
    start = comma + 1;
    if (item.empty()) {
      if (comma == body.size() && !f.entries_.empty()) break;  // tolerate a trailing comma
      return Status(Code::kInvalidArgument, "PONTE_IB_HCA=\"%.60s\": empty device name", text.c_str());
    }
    Entry e;
    size_t colon = item.find(':');
    if (colon != std::string::npos) {
      std::string port = trim(item.substr(colon + 1));
      item = trim(item.substr(0, colon));
      if (port.empty() || port.size() > 3) {
        return Status(Code::kInvalidArgument, "PONTE_IB_HCA=\"%.60s\": bad port \"%.10s\"",
                      text.c_str(), port.c_str());
      }
      int value = 0;
      for (char c : port) {
        if (!isdigit(static_cast<unsigned char>(c))) {
          return Status(Code::kInvalidArgument, "PONTE_IB_HCA=\"%.60s\": bad port \"%.10s\"",
                        text.c_str(), port.c_str());
        }
        value = value * 10 + (c - '0');
      }
      if (value < 1 || value > 255) {
        return Status(Code::kInvalidArgument, "PONTE_IB_HCA=\"%.60s\": port %d out of 1..255",
                      text.c_str(), value);
      }
      e.port = value;
    }
    if (item.empty() || item.size() > kMaxDeviceName) {
      return Status(Code::kInvalidArgument, "PONTE_IB_HCA=\"%.60s\": bad device name", text.c_str());
    }
    e.name = item;
    f.entries_.push_back(std::move(e));
    if (comma == body.size()) break;
  }
  if (f.entries_.empty()) {
    return Status(Code::kInvalidArgument, "PONTE_IB_HCA=\"%.60s\": no device listed", text.c_str());
  }
  return f;
}

bool HcaFilter::accepts(const std::string& device, int port) const {
  if (entries_.empty()) return true;
  bool listed = false;
  for (const Entry& e : entries_) {
    bool name_ok = exact_ ? device == e.name : device.compare(0, e.name.size(), e.name) == 0;
    if (name_ok && (e.port < 0 || e.port == port)) {
      listed = true;
      break;
    }
  }
  return exclude_ ? !listed : listed;
}

}  // namespace ponte::verbs
