// ponte-soak's plugin half: libnccl-net-ponte.so loaded with dlopen and driven as NCCL's proxy
// thread drives it (never blocking: post, poll test(), yield only after a pass that made no
// progress), both directions at once between the two processes.
#pragma once

#include "tests/soak/soak_support.h"

namespace ponte::soak {

class PluginSoak {
 public:
  // Loads and initialises the plugin (one context for the process's life, as NCCL keeps it) and
  // picks its device 0, or a virtual device over o.nics copies of it.
  PluginSoak(const Options& o, const Channel& ch);
  ~PluginSoak();
  PluginSoak(const PluginSoak&) = delete;
  PluginSoak& operator=(const PluginSoak&) = delete;

  // Opens a comm each way, moves bytes_each_way in each direction (stream ids out and in), verifies
  // what arrives, deregisters and closes. Returns what this side received.
  StreamResult stream(uint64_t bytes_each_way, uint64_t out, uint64_t in);
  // n times: listen, connect + accept, regMr of freshly allocated buffers, one verified message
  // each way, deregMr, close; cycle numbers first..first+n-1. Returns the cycles that verified.
  int cycles(int first, int n, uint64_t out, uint64_t in);
  // Frees what closed comms still hold: a closed comm waits in the plugin for its last engine
  // operations and the other end's close acknowledgement, and is freed by the plugin's next
  // listen/connect/accept/close (transport_teardown.cc), so a snapshot right after the last close
  // would count its registrations. Waits for those, then listens and closes the listener.
  void quiesce();
  long warnings() const;  // WARN lines the plugin logged

 private:
  struct Comms {
    void* send = nullptr;
    void* recv = nullptr;
    void* listen = nullptr;
  };
  Comms open();
  void close(Comms& c);
  void check(int result, const char* what) const;

  const Options& o_;
  const Channel& ch_;
  void* table_ = nullptr;  // the plugin's ncclNetPlugin_v11
  void* ctx_ = nullptr;
  int dev_ = 0;
};

}  // namespace ponte::soak
