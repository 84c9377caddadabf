// ponte-topo: prints the topology table ponte uses (GPU -> NICs, cores, rule; host-memory groups)
// for the live host, an hwloc XML file (--xml or PONTE_TOPO_FILE), as text or as JSON (--json).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ponte_version.h"
#include "topology/cuda_bus_id.h"
#include "topology/topology.h"

namespace {

void usage(FILE* to) {
  std::fprintf(to,
               "usage: ponte-topo [--xml FILE] [--json] [--version]\n"
               "  --xml FILE  read an hwloc XML export (lstopo --of xml) instead of the live host;\n"
               "              PONTE_TOPO_FILE=FILE does the same when --xml is not given\n"
               "  --json      print JSON instead of a table\n"
               "  --version   print ponte's version and exit\n");
}

}  // namespace

int main(int argc, char** argv) {
  ponte::topo::Options options;
  bool json = false;
  bool xml_given = false;
  for (int i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    if (std::strcmp(arg, "--json") == 0) {
      json = true;
    } else if (std::strcmp(arg, "--xml") == 0) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "ponte-topo: --xml needs a file\n");
        usage(stderr);
        return 2;
      }
      options.xml_file = argv[++i];
      xml_given = true;
    } else if (std::strncmp(arg, "--xml=", 6) == 0) {
      options.xml_file = arg + 6;
      xml_given = true;
    } else if (std::strcmp(arg, "--version") == 0) {
      std::printf("ponte-topo %s\n", PONTE_VERSION_STRING);
      return 0;
    } else if (std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0) {
      usage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "ponte-topo: unknown argument '%s'\n", arg);
      usage(stderr);
      return 2;
    }
  }
  if (xml_given && options.xml_file.empty()) {
    std::fprintf(stderr, "ponte-topo: --xml needs a file\n");
    return 2;
  }
  if (!xml_given) {
    const char* env = std::getenv("PONTE_TOPO_FILE");
    if (env != nullptr) options.xml_file = env;
  }

  const ponte::topo::Result result = ponte::topo::discover(options);
  if (!result.ok) {
    std::fprintf(stderr, "ponte-topo: %s\n", result.error.c_str());
    return 1;
  }
  if (json) {
    std::fputs(ponte::topo::to_json(result.table).c_str(), stdout);
    return 0;
  }
  std::printf("ponte topology of %s: ", result.source.c_str());
  std::fputs(ponte::topo::to_text(result.table).c_str(), stdout);
  if (options.xml_file.empty()) {
    // CUDA ordinals of this process -> the GPUs above, by bus id.
    const ponte::topo::CudaBusIds cuda = ponte::topo::cuda_pci_bus_ids();
    if (!cuda.ok) {
      std::printf("\nCUDA devices: %s\n", cuda.error.c_str());
    } else {
      std::printf("\nCUDA devices: %zu\n", cuda.pci.size());
      for (size_t i = 0; i < cuda.pci.size(); ++i) {
        const int gpu = ponte::topo::find_gpu(result.table, cuda.pci[i]);
        std::printf("  cuda %zu -> %s%s\n", i, cuda.pci[i].c_str(), gpu < 0 ? " (not in the table)" : "");
      }
    }
  }
  return 0;
}
