// Lab: the two-node network of tests/faults/netlab, built by a test process for itself. The test
// process is node a (it enters namespace NAME-a before any thread starts), its peer processes are
// node b. A reaper process removes the lab when the test process ends, however it ends (a crash,
// SIGKILL from ctest's timeout): it waits for the end of a pipe only the test process holds.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace ponte::test {

class Lab {
 public:
  static Lab& get() {
    static Lab lab;
    return lab;
  }
  // Builds the lab (named after this process) and enters node a. Call first thing in main(),
  // before any thread exists: a network namespace is entered per thread. Returns false (and
  // why()) when no lab can be built here.
  bool start(const char* wire_binary) {
    std::string out;
    if (run_capture(std::string(PONTE_NETLAB) + " check", &out) != 0) {
      why_ = out.empty() ? "netlab check failed" : out;
      return false;
    }
    name_ = "nf" + std::to_string(getpid() % 1000000);
    int fds[2];
    if (pipe(fds) != 0) return (why_ = "pipe failed", false);
    pid_t reaper = fork();
    if (reaper == 0) {
      // Out of ctest's process group: its kill on a timeout must not take the reaper too.
      setsid();
      signal(SIGINT, SIG_IGN);
      signal(SIGTERM, SIG_IGN);
      ::close(fds[1]);
      char c;
      while (read(fds[0], &c, 1) > 0) {
      }
      execl(PONTE_NETLAB, PONTE_NETLAB, "down", name_.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    ::close(fds[0]);
    fcntl(fds[1], F_SETFD, FD_CLOEXEC);  // held by this process only, not by the peers it starts
    setenv("PONTE_NETLAB_WIRE", wire_binary, 1);
    if (run_capture(std::string(PONTE_NETLAB) + " up " + name_ + " 9000", &out) != 0) {
      why_ = "netlab up failed: " + out;
      return false;
    }
    up_ = true;
    setenv("PONTE_NETLAB_NAME", name_.c_str(), 1);  // the peer processes find their node by it
    if (!enter('a')) return (why_ = "cannot enter namespace " + name_ + "-a", false);
    return true;
  }
  bool up() const { return up_; }
  const std::string& why() const { return why_; }
  const std::string& name() const { return name_; }
  std::string ns(char node) const { return name_ + "-" + node; }
  std::string iface(char node) const { return name_ + node + "0"; }
  static const char* ip(char node) { return node == 'a' ? "10.77.0.1" : "10.77.0.2"; }
  // This process (a single thread) joins node's namespace and binds its NIC there. A peer
  // process started by the test finds the lab's name in its environment.
  bool enter(char node) {
    if (name_.empty() && getenv("PONTE_NETLAB_NAME")) name_ = getenv("PONTE_NETLAB_NAME");
    int fd = open(("/run/netns/" + ns(node)).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    int rc = setns(fd, CLONE_NEWNET);
    ::close(fd);
    setenv("FI_TCP_IFACE", iface(node).c_str(), 1);
    setenv("PONTE_CTRL_ADDR", ip(node), 1);
    return rc == 0;
  }
  // "loss=2 delay_us=1000 ..." on both directions; "" is a clean link.
  bool impair(const std::string& args) const { return netlab("impair " + name_ + " " + args); }
  bool link(char node, bool up) const {
    return netlab("link " + name_ + " " + node + (up ? " up" : " down"));
  }
  std::string mode() const {
    std::string out;
    run_capture(std::string(PONTE_NETLAB) + " mode " + name_, &out);
    return out;
  }
  // Frames the impairment dropped so far (both directions), -1 when unknown.
  long lost() const {
    std::string out;
    if (run_capture(std::string(PONTE_NETLAB) + " stats " + name_, &out) != 0) return -1;
    auto p = out.find("lost=");
    return p == std::string::npos ? -1 : strtol(out.c_str() + p + 5, nullptr, 10);
  }

 private:
  bool netlab(const std::string& args) const {
    std::string out;
    int rc = run_capture(std::string(PONTE_NETLAB) + " " + args, &out);
    if (rc != 0) fprintf(stderr, "netlab %s: exit %d: %s\n", args.c_str(), rc, out.c_str());
    return rc == 0;
  }
  static int run_capture(const std::string& cmd, std::string* out) {
    out->clear();
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    if (!p) return -1;
    char buf[512];
    while (fgets(buf, sizeof(buf), p)) *out += buf;
    int st = pclose(p);
    while (!out->empty() && out->back() == '\n') out->pop_back();
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::string name_, why_;
  bool up_ = false;
};

}  // namespace ponte::test
