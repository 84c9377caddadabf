// PeerProcess: this test binary started again as a second process (its own engine or plugin), with
// a Channel (socketpair) to exchange addresses and verdicts. Shared by tests/engine and tests/plugin.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <poll.h>
#include <string>
#include <vector>

namespace ponte::test {

// Length-prefixed messages over a stream socket, with a deadline on reads.
class Channel {
 public:
  explicit Channel(int fd = -1) : fd_(fd) {}
  int fd() const { return fd_; }
  bool send(const std::vector<uint8_t>& m) const {
    uint32_t n = static_cast<uint32_t>(m.size());
    return write_all(&n, 4) && write_all(m.data(), m.size());
  }
  bool send(const void* p, size_t n) const {
    uint32_t len = static_cast<uint32_t>(n);
    return write_all(&len, 4) && write_all(p, n);
  }
  bool send_str(const std::string& s) const { return send(s.data(), s.size()); }
  // Empty optional-like: returns false on EOF or timeout.
  bool recv(std::vector<uint8_t>* m, int timeout_ms = 60000) const {
    uint32_t n = 0;
    if (!read_all(&n, 4, timeout_ms)) return false;
    m->resize(n);
    return read_all(m->data(), n, timeout_ms);
  }
  bool recv_str(std::string* s, int timeout_ms = 60000) const {
    std::vector<uint8_t> m;
    if (!recv(&m, timeout_ms)) return false;
    s->assign(m.begin(), m.end());
    return true;
  }

 private:
  bool write_all(const void* p, size_t n) const {
    const char* c = static_cast<const char*>(p);
    while (n) {
      ssize_t w = ::send(fd_, c, n, MSG_NOSIGNAL);  // a dead peer is a failed send, not SIGPIPE
      if (w <= 0) return false;
      c += w;
      n -= static_cast<size_t>(w);
    }
    return true;
  }
  bool read_all(void* p, size_t n, int timeout_ms) const {
    char* c = static_cast<char*>(p);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (n) {
      int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                      deadline - std::chrono::steady_clock::now()).count());
      if (left <= 0) return false;
      pollfd pfd{fd_, POLLIN, 0};
      if (::poll(&pfd, 1, left) <= 0) continue;
      ssize_t r = ::read(fd_, c, n);
      if (r <= 0) return false;
      c += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  int fd_;
};

// The name libfabric's shm gives region idx of process pid: "/PID:UID:INDEX" in /dev/shm.
inline std::string shm_region_name(pid_t pid, int idx) {
  char name[64];
  std::snprintf(name, sizeof(name), "/%d:%u:%d", static_cast<int>(pid), static_cast<unsigned>(getuid()), idx);
  return name;
}

class PeerProcess {
 public:
  // Starts this test binary again as a peer: `exe --ponte-peer ARGS...` with the channel on fd 3 and
  // extra environment entries ("NAME=value"). fork + exec at once: the parent may already run
  // engine threads, and a forked copy of a threaded libfabric is not safe to use.
  explicit PeerProcess(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return;
    std::vector<std::string> argv_s = {"/proc/self/exe", "--ponte-peer"};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_s = env;
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    pid_ = fork();
    if (pid_ == 0) {
      dup2(sv[1], 3);  // dup2 clears close-on-exec on fd 3
      for (char* e : envp) putenv(e);
      execv("/proc/self/exe", argv.data());
      _exit(127);
    }
    ::close(sv[1]);
    ch_ = Channel(sv[0]);
  }
  ~PeerProcess() {
    if (pid_ > 0) {
      kill();
      wait_exit(5000);
    }
    if (ch_.fd() >= 0) ::close(ch_.fd());
  }
  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  Channel& channel() { return ch_; }
  const Channel& channel() const { return ch_; }
  void kill() {
    if (pid_ > 0) ::kill(pid_, SIGKILL);
  }
  // SIGSTOP, SIGCONT, ...: a peer that stops without dying (tests/liveness).
  bool signal(int sig) const { return pid_ > 0 && ::kill(pid_, sig) == 0; }
  // Exit status (>= 0) or -1 on timeout / signal.
  int wait_exit(int timeout_ms) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (pid_ > 0) {
      siginfo_t info{};
      if (waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
          info.si_pid == pid_ && (info.si_code == CLD_KILLED || info.si_code == CLD_DUMPED))
        remove_shm_regions();
      int st = 0;
      pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      }
      if (std::chrono::steady_clock::now() > deadline) return -1;
      usleep(2000);
    }
    return -1;
  }

 private:
  // A process killed by a signal leaves its shm regions (shm_region_name) in /dev/shm. A test
  // that killed its peer removes them while the peer is a zombie (its pid not yet free for
  // reuse), so that runs of the suite do not fill /dev/shm.
  void remove_shm_regions() const {
    for (int idx = 0; idx < 64; ++idx) shm_unlink(shm_region_name(pid_, idx).c_str());
  }

  pid_t pid_ = -1;
  Channel ch_;
};

}  // namespace ponte::test
