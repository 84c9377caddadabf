// Which IPv4 address an engine advertises for its control socket when PONTE_CTRL_ADDR is unset:
// checked in network namespaces of its own (root), with interfaces a GPU node has beside its NIC.
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/control_socket.h"
#include "tests/common/child_exit.h"

using namespace ponte;

namespace {

// In a child of its own: a fresh network namespace, `setup` run there by the shell (ip commands),
// then control_listen with PONTE_SOCKET_IFNAME = ifname; the advertised address comes back over a
// pipe. "" and a note in *why when the namespace cannot be made.
std::string advertised_in_fresh_netns(const std::string& setup, const std::string& ifname, std::string* why) {
  int fds[2];
  if (pipe(fds) != 0) {
    *why = "pipe failed";
    return "";
  }
  const pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    auto answer = [&](const std::string& s) {
      (void)!write(fds[1], s.data(), s.size());
      _exit(0);
    };
    if (unshare(CLONE_NEWNET) != 0) answer("!unshare(CLONE_NEWNET) failed (needs root)");
    if (std::system(("set -e; " + setup).c_str()) != 0) answer("!the ip commands failed: " + setup);
    Config cfg;
    cfg.socket_ifname = ifname;
    ControlEndpoint ep;
    auto fd = control_listen(cfg, &ep);
    if (!fd.ok()) answer(std::string("!control_listen: ") + fd.status().message());
    close(*fd);
    std::string s = ep.to_string();
    answer(s.substr(0, s.rfind(':')));
  }
  close(fds[1]);
  std::string out;
  char buf[256];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  const int rc = test::wait_child_exit(child, std::chrono::seconds(30));
  if (rc != 0) {
    *why = "the child exited with " + std::to_string(rc);
    return "";
  }
  if (!out.empty() && out[0] == '!') {
    *why = out.substr(1);
    return "";
  }
  return out;
}

// A veth pair: `up` brings the peer up too (the interface is running); otherwise it has no carrier,
// like a port with no cable or docker0 with no container.
std::string veth(const std::string& name, const std::string& addr, bool running) {
  return "ip link add " + name + " type veth peer name " + name + "x; ip addr add " + addr + " dev " + name +
         "; ip link set " + name + " up; " + (running ? "ip link set " + name + "x up; " : "");
}

class ControlAddress : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "SKIPPED: network namespaces need root (this is uid " << geteuid() << ")";
  }
};

// docker0 is listed first and is up and running, an unplugged port next: neither is the node's
// address; eth7 is.
TEST_F(ControlAddress, SkipsLocalBridgesAndInterfacesWithoutCarrier) {
  std::string why;
  const std::string setup = veth("docker0", "172.17.0.1/16", true) + veth("ens9", "10.9.0.1/24", false) +
                            veth("virbr0", "192.168.122.1/24", true) + veth("eth7", "10.8.0.7/24", true);
  EXPECT_EQ(advertised_in_fresh_netns(setup, "", &why), "10.8.0.7") << why;
}

// With nothing better, a local bridge is still better than loopback; with nothing up, loopback.
TEST_F(ControlAddress, FallsBackToAnUpInterfaceThenToLoopback) {
  std::string why;
  EXPECT_EQ(advertised_in_fresh_netns(veth("ens9", "10.9.0.1/24", false) + veth("docker0", "172.17.0.1/16", true),
                                      "", &why),
            "10.9.0.1") << why;
  EXPECT_EQ(advertised_in_fresh_netns("true", "", &why), "127.0.0.1") << why;
}

// PONTE_SOCKET_IFNAME names the interface, whatever it is.
TEST_F(ControlAddress, SocketIfnameWins) {
  std::string why;
  const std::string setup = veth("eth7", "10.8.0.7/24", true) + veth("docker0", "172.17.0.1/16", true);
  EXPECT_EQ(advertised_in_fresh_netns(setup, "docker0", &why), "172.17.0.1") << why;
  EXPECT_EQ(advertised_in_fresh_netns(setup, "eth9", &why), "") << "an absent interface was accepted";
  EXPECT_NE(why.find("eth9"), std::string::npos) << why;
}

}  // namespace
