// ponte-topo as a user runs it: --xml, PONTE_TOPO_FILE, --json (parsed), the text table, and the
// exit status and message for bad files and bad arguments.
#include <gtest/gtest.h>

#include "tests/topology/topo_test_util.h"
#include "topology/topology.h"

namespace ponte::topo {
namespace {

using testing::fixture;
using testing::Json;
using testing::JsonReader;
using testing::run;
using testing::shell_quote;

std::string tool() { return "env -u PONTE_TOPO_FILE " + shell_quote(PONTE_TOPO_EXE); }

TEST(Cli, JsonFromXmlFile) {
  const auto r = run(tool() + " --xml " + shell_quote(fixture("two_gpus_dual_port.xml")) + " --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  Json j;
  JsonReader reader(r.out);
  ASSERT_TRUE(reader.parse(j)) << reader.error() << "\n" << r.out;
  ASSERT_EQ(j["gpus"].items.size(), 2u);
  EXPECT_EQ(j["gpus"][0]["pci"].text, "0000:03:00.0");
  EXPECT_EQ(j["gpus"][0]["numa"].number, 0);
  EXPECT_EQ(j["gpus"][0]["rule"].text, "switch");
  EXPECT_EQ(j["gpus"][0]["nics"][0]["pci"].text, "0000:05:00.0");
  EXPECT_EQ(j["gpus"][0]["nics"][0]["name"].text, "mlx5_0");
  EXPECT_EQ(j["gpus"][0]["nics"][0]["distance"].text, "PIX");
  EXPECT_EQ(j["gpus"][1]["nics"][0]["name"].text, "mlx5_1");
  EXPECT_EQ(j["gpus"][1]["cpus"].items.size(), 2u);
  EXPECT_EQ(j["nics"][1]["pci"].text, "0000:05:00.1");
  EXPECT_TRUE(j.has("host_groups"));
  EXPECT_EQ(j["warnings"].items.size(), 0u);
  // Same as the library's rendering.
  const Result lib = discover(Options{fixture("two_gpus_dual_port.xml")});
  EXPECT_EQ(r.out, to_json(lib.table));
}

TEST(Cli, EnvironmentSelectsTheFileAndXmlOverridesIt) {
  const std::string file = fixture("fallbacks.xml");
  const auto by_flag = run(tool() + " --json --xml=" + shell_quote(file));
  const auto by_env = run("env PONTE_TOPO_FILE=" + shell_quote(file) + " " + shell_quote(PONTE_TOPO_EXE) + " --json");
  ASSERT_EQ(by_flag.rc, 0) << by_flag.err;
  ASSERT_EQ(by_env.rc, 0) << by_env.err;
  EXPECT_EQ(by_flag.out, by_env.out);
  EXPECT_NE(by_env.out.find("\"rule\":\"package\""), std::string::npos);
  const auto overridden = run("env PONTE_TOPO_FILE=" + shell_quote(fixture("broken.xml")) + " " +
                              shell_quote(PONTE_TOPO_EXE) + " --json --xml " + shell_quote(file));
  EXPECT_EQ(overridden.rc, 0) << overridden.err;
  EXPECT_EQ(overridden.out, by_flag.out);
}

TEST(Cli, TextTableFromFile) {
  const auto r = run(tool() + " --xml " + shell_quote(fixture("fallbacks.xml")));
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* part : {"4 GPU(s), 2 RDMA NIC(s), 4 NUMA node(s)", "0000:20:00.0", "numa", "package",
                           "any", "mlx5_1 0000:30:00.0 NODE", "PIX", "HOST MEMORY", "warnings:"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from:\n" << r.out;
  }
  EXPECT_EQ(r.out.find("CUDA devices"), std::string::npos) << "CUDA ordinals are about this host only";
}

TEST(Cli, LiveHost) {
  const auto text = run(tool());
  ASSERT_EQ(text.rc, 0) << text.err;
  EXPECT_NE(text.out.find("ponte topology of live host"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("HOST MEMORY"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("CUDA devices"), std::string::npos) << text.out;
  const auto json = run(tool() + " --json");
  ASSERT_EQ(json.rc, 0) << json.err;
  Json j;
  JsonReader reader(json.out);
  ASSERT_TRUE(reader.parse(j)) << reader.error();
  EXPECT_EQ(json.out, to_json(discover(Options{}).table)) << "the tool and the library agree";
}

void expect_failure(const std::string& args, int rc, const std::string& message) {
  const auto r = run(tool() + " " + args);
  EXPECT_EQ(r.rc, rc) << args << "\nstdout: " << r.out << "\nstderr: " << r.err;
  EXPECT_NE(r.err.find(message), std::string::npos) << args << "\nstderr: " << r.err;
  EXPECT_EQ(r.out, "") << "nothing on stdout after an error";
}

TEST(Cli, BadFilesExitNonZeroWithAClearMessage) {
  expect_failure("--xml " + shell_quote(fixture("no-such.xml")) + " --json", 1,
                 "ponte-topo: cannot read topology file");
  expect_failure("--xml " + shell_quote(fixture("broken.xml")), 1, "not a valid hwloc XML");
  expect_failure("--xml " + shell_quote(fixture("version3.xml")), 1, "XML v3");
  const auto by_env = run("env PONTE_TOPO_FILE=/nonexistent/topo.xml " + shell_quote(PONTE_TOPO_EXE));
  EXPECT_EQ(by_env.rc, 1);
  EXPECT_NE(by_env.err.find("/nonexistent/topo.xml"), std::string::npos) << by_env.err;
}

TEST(Cli, BadArgumentsExitTwo) {
  expect_failure("--bogus", 2, "unknown argument '--bogus'");
  expect_failure("--xml", 2, "--xml needs a file");
  expect_failure("--xml=", 2, "--xml needs a file");
  const auto help = run(tool() + " --help");
  EXPECT_EQ(help.rc, 0);
  EXPECT_NE(help.out.find("usage: ponte-topo"), std::string::npos);
}

}  // namespace
}  // namespace ponte::topo
