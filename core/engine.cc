// Engine: builds the backend and NIC groups, validates every request at the API border, and
// hands operations to the owning group's worker.
#include "core/engine.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>

#include "core/cuda_memory.h"
#include "core/group_address.h"
#include "core/log.h"
#include "core/nic_group.h"
#include "core/topology_layout.h"
#include "core/watchdog.h"

namespace ponte {

// fork(): the child has none of an engine's threads (workers, watchdog) and shares the parent's
// sockets and provider state. There every call fails at once (no worker would ever end an
// operation, and a poll could take bytes off the parent's connections), and the destructor leaves
// everything as it is: joining threads that do not exist hung a child at its exit, and closing
// the parent's endpoints could disturb its connections. Forks are counted in the child by a
// pthread_atfork handler that the first engine installs (glibc removes it if ponte is unloaded).
static std::atomic<uint64_t> g_forks{0};
static void count_fork_in_child() { g_forks.fetch_add(1, std::memory_order_relaxed); }

struct Engine::Impl {
  uint64_t forks_at_create = g_forks.load(std::memory_order_relaxed);
  pid_t creator = getpid();
  EngineOptions opts;
  std::unique_ptr<Backend> backend;
  std::vector<std::unique_ptr<NicGroup>> groups;
  std::unique_ptr<Watchdog> watchdog;  // sees a group whose worker is stuck in a provider call
  uint64_t nonce = 0;
  std::atomic<uint64_t> next_mr_id{1};
  std::vector<std::string> group_gpus;

  // This process is a fork() child of the one that created the engine.
  bool forked() const { return g_forks.load(std::memory_order_relaxed) != forks_at_create; }
  // nullptr for an unknown index, and for every index in a fork() child.
  NicGroup* group(int g) const {
    return (g >= 0 && g < static_cast<int>(groups.size()) && !forked()) ? groups[g].get() : nullptr;
  }
  Status forked_error() const {
    return Status(Code::kUnavailable,
                  "this engine belongs to process %d: after fork() process %d cannot use it (its threads "
                  "stayed in the parent); create a new engine here",
                  static_cast<int>(creator), static_cast<int>(getpid()));
  }
};

RemoteRegion MemoryRegion::remote() const {
  RemoteRegion r;
  r.addr = reinterpret_cast<uint64_t>(addr);
  r.len = len;
  r.nics = static_cast<uint8_t>(nic_mrs.size());
  for (size_t i = 0; i < nic_mrs.size() && i < static_cast<size_t>(kMaxNicsPerGroup); i++) {
    r.rkey[i] = nic_mrs[i].rkey;
    r.remote_base[i] = nic_mrs[i].remote_base;
  }
  return r;
}

Engine::Engine() : impl_(std::make_unique<Impl>()) {}

// A wedged group (core/watchdog.h) may have a thread inside one of its NICs for good: it, its
// NICs and the backend they came from are kept for the life of the process, reachable from here.
static std::vector<void*>& kept_for_good() {
  static auto* kept = new std::vector<void*>;
  return *kept;
}

Engine::~Engine() {
  if (impl_->forked()) {  // the parent's: nothing here to stop or close (see g_forks)
    kept_for_good().push_back(impl_.release());
    return;
  }
  for (auto& g : impl_->groups) g->stop();  // the watchdog still watches: a stuck shutdown is a wedge
  if (impl_->watchdog) impl_->watchdog->stop();
  bool keep_backend = false;
  for (auto& g : impl_->groups) {
    if (!g->abandoned()) continue;
    g->refuse_queued();  // what raced the verdict after the watchdog's last look
    kept_for_good().push_back(g.release());
    keep_backend = true;
  }
  impl_->groups.clear();
  if (keep_backend) kept_for_good().push_back(impl_->backend.release());
}

static Result<std::unique_ptr<Backend>> choose_backend(const Config& cfg) {
  switch (cfg.backend) {
    case BackendChoice::kFabric: return open_fabric_backend(cfg);
    case BackendChoice::kVerbs: return open_verbs_backend(cfg);
    case BackendChoice::kAuto: break;
  }
  auto verbs = open_verbs_backend(cfg);
  if (verbs.ok() && !(*verbs)->devices().empty()) return verbs;
  auto fabric = open_fabric_backend(cfg);
  if (fabric.ok() && !(*fabric)->devices().empty()) return fabric;
  // Each reason in full in the log: the status has room for about 120 bytes, and the two
  // together (a kernel without RDMA, a provider without RDM) do not fit.
  const char* vwhy = verbs.ok() ? "no active port" : verbs.status().message();
  const char* fwhy = fabric.ok() ? "no device" : fabric.status().message();
  PONTE_LOG_WARN("no RDMA backend: verbs: %s", vwhy);
  PONTE_LOG_WARN("no RDMA backend: fabric (PONTE_FABRIC_PROVIDER=%s): %s", cfg.fabric_provider.c_str(), fwhy);
  return Status(Code::kUnavailable, "no RDMA backend (PONTE_BACKEND=auto; each reason is logged): fabric (%s): %s; verbs: %s",
                cfg.fabric_provider.c_str(), fwhy, vwhy);
}

Result<std::unique_ptr<Engine>> Engine::create(EngineOptions opts) {
  static std::once_flag fork_watch;
  std::call_once(fork_watch, [] { pthread_atfork(nullptr, nullptr, count_fork_in_child); });
  std::unique_ptr<Engine> e(new Engine());
  Impl& im = *e->impl_;
  im.opts = std::move(opts);
  const Config& cfg = im.opts.config;
  PONTE_ASSIGN_OR_RETURN(im.backend, choose_backend(cfg));
  const auto& devs = im.backend->devices();
  if (devs.empty()) return Status(Code::kUnavailable, "the %s backend offers no NIC", backend_name(im.backend->kind()));
  std::random_device rd;
  im.nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid());

  // Cores the caller named must be usable; the ones the topology picks (per_gpu_groups) are best
  // effort, as a container's cpuset may leave them out.
  PONTE_RETURN_IF_ERROR(check_cores_usable(cfg.progress_cores, "PONTE_PROGRESS_CORES"));
  for (const auto& cores : im.opts.group_cores) PONTE_RETURN_IF_ERROR(check_cores_usable(cores, "group_cores"));
  auto groups = im.opts.groups;
  if (groups.empty() && im.opts.per_gpu_groups) {
    PONTE_ASSIGN_OR_RETURN(auto layout, gpu_layout(devs, cfg));
    im.opts.group_cores.clear();
    for (auto& l : layout) {
      groups.push_back(l.devices);
      im.opts.group_cores.push_back(cfg.progress_cores.empty() ? l.cores : std::vector<int>{});
      im.group_gpus.push_back(l.gpu_pci);
    }
  }
  if (groups.empty()) {
    size_t n = cfg.nics_per_group ? static_cast<size_t>(cfg.nics_per_group) : std::min<size_t>(devs.size(), kMaxNicsPerGroup);
    std::vector<size_t> g;
    for (size_t i = 0; i < n; i++) g.push_back(i % devs.size());  // repeats stand for more NICs on loopback
    groups.push_back(g);
  }
  if (groups.size() > 255) return Status(Code::kInvalidArgument, "%zu groups: at most 255", groups.size());
  for (size_t gi = 0; gi < groups.size(); gi++) {
    const auto& g = groups[gi];
    if (g.empty() || g.size() > static_cast<size_t>(kMaxNicsPerGroup))
      return Status(Code::kInvalidArgument, "group %zu has %zu NICs: expected 1..%d", gi, g.size(), kMaxNicsPerGroup);
    std::vector<std::unique_ptr<Nic>> nics;
    for (size_t d : g) {
      if (d >= devs.size()) return Status(Code::kInvalidArgument, "group %zu: device %zu of %zu", gi, d, devs.size());
      PONTE_ASSIGN_OR_RETURN(auto nic, im.backend->open_nic(d));
      nics.push_back(std::move(nic));
    }
    auto grp = std::make_unique<NicGroup>(static_cast<int>(gi), cfg, std::move(nics), im.backend->kind(), im.nonce,
                                          im.opts.dense_imm_values);
    std::vector<int> cores;
    if (gi < im.opts.group_cores.size()) cores = im.opts.group_cores[gi];
    if (cores.empty() && !cfg.progress_cores.empty()) cores = {cfg.progress_cores[gi % cfg.progress_cores.size()]};
    PONTE_RETURN_IF_ERROR(grp->start(cores));
    PONTE_LOG_INFO("group %zu: %zu NICs over %s (%s), first %s", gi, g.size(), backend_name(im.backend->kind()),
                   devs[g[0]].provider.c_str(), devs[g[0]].name.c_str());
    im.groups.push_back(std::move(grp));
  }
  std::vector<NicGroup*> watched;
  for (auto& g : im.groups) watched.push_back(g.get());
  im.watchdog = std::make_unique<Watchdog>(std::move(watched));
  im.watchdog->start();
  return e;
}

std::string Engine::group_gpu(int group) const {
  return (group >= 0 && static_cast<size_t>(group) < impl_->group_gpus.size()) ? impl_->group_gpus[group] : std::string();
}

BackendKind Engine::backend() const { return impl_->backend->kind(); }
const std::vector<NicInfo>& Engine::devices() const { return impl_->backend->devices(); }
int Engine::num_groups() const { return static_cast<int>(impl_->groups.size()); }
int Engine::nics_in_group(int group) const {
  NicGroup* g = impl_->group(group);
  return g ? g->nic_count() : 0;
}
const NicInfo& Engine::nic_info(int group, int nic) const { return impl_->groups.at(group)->nic_info(nic); }
std::vector<uint8_t> Engine::address(int group) const {
  NicGroup* g = impl_->group(group);
  return g ? g->address() : std::vector<uint8_t>{};
}

#define PONTE_GROUP_OR_RETURN(g, index)                                                   \
  if (impl_->forked()) return impl_->forked_error();                                      \
  NicGroup* g = impl_->group(index);                                                      \
  if (!g) return Status(Code::kInvalidArgument, "no group %d (engine has %zu)", index, \
                        impl_->groups.size())

Result<PeerId> Engine::connect(int group, std::span<const uint8_t> peer_address, const ConnectOptions& options) {
  PONTE_GROUP_OR_RETURN(g, group);
  if (options.traffic_class < -1 || options.traffic_class > 255)
    return Status(Code::kInvalidArgument, "connect: traffic class %d (0..255, or -1)", options.traffic_class);
  auto addr = GroupAddress::decode(peer_address);
  if (!addr.ok()) return addr.status();
  if (addr->backend != impl_->backend->kind())
    return Status(Code::kInvalidArgument, "peer address is for the %s backend, this engine runs %s",
                  backend_name(addr->backend), backend_name(impl_->backend->kind()));
  bool existing = false;
  PONTE_ASSIGN_OR_RETURN(PeerId id, g->new_outbound_peer(*addr, options.traffic_class, &existing));
  if (existing) return id;  // connected already (either way): that connection serves both
  Op op;
  op.type = Op::kConnect;
  op.peer = id;
  PONTE_RETURN_IF_ERROR(g->submit(op));  // refused: the peer fails its handshake deadline
  return id;
}

bool Engine::peer_ready(int group, PeerId peer) const {
  NicGroup* g = impl_->group(group);
  return g && !g->wedged() && g->peer_ready(peer);
}
uint32_t Engine::peer_epoch(int group, PeerId peer) const {
  NicGroup* g = impl_->group(group);
  return g ? g->peer_epoch(peer) : 0;
}
bool Engine::peer_dead(int group, PeerId peer) const {
  NicGroup* g = impl_->group(group);
  return g && (g->wedged() || g->peer_dead(peer));
}
Status Engine::group_status(int group) const {
  PONTE_GROUP_OR_RETURN(g, group);
  return g->wedge_status();
}
int Engine::peer_nics(int group, PeerId peer) const {
  NicGroup* g = impl_->group(group);
  return g ? g->peer_nics(peer) : 0;
}
std::vector<PeerId> Engine::peers(int group) const {
  NicGroup* g = impl_->group(group);
  return g ? g->inbound_peers() : std::vector<PeerId>{};
}

namespace {
// Jobs for NicGroup::run_on_worker: values only, the worker runs a copy.
struct RegisterJob {
  NicGroup* g;
  MemoryDesc md;
  std::vector<NicMr> out;
  Status st;
  void run() {
    for (int i = 0; i < g->nic_count(); i++) {
      auto r = g->nic(i).register_memory(md);
      if (!r.ok()) {
        st = r.status();
        for (auto& m : out) g->nic(static_cast<int>(&m - out.data())).deregister(m);
        out.clear();
        return;
      }
      out.push_back(*r);
    }
  }
};
struct DeregisterJob {
  NicGroup* g;
  std::vector<NicMr> mrs;
  void run() {
    for (size_t i = 0; i < mrs.size(); i++) g->nic(static_cast<int>(i)).deregister(mrs[i]);
  }
};
}  // namespace

Result<MemoryRegion> Engine::register_memory(int group, void* addr, size_t len, MemKind kind, int cuda_device,
                                             int dmabuf_fd, uint64_t dmabuf_offset) {
  PONTE_GROUP_OR_RETURN(g, group);
  if (!addr || len == 0) return Status(Code::kInvalidArgument, "register_memory: null address or zero length");
  RegisterJob job{g, {}, {}, Status::Ok()};
  job.md.addr = addr;
  job.md.len = len;
  job.md.kind = kind;
  job.md.cuda_device = cuda_device;
  CudaDmabuf dmabuf;
  if (kind == MemKind::kCuda && cuda_device < 0) {
    auto dev = cuda_device_of(addr);
    if (dev.ok()) job.md.cuda_device = dev.value();
    else PONTE_LOG_INFO("CUDA memory %p: %s", addr, dev.status().message());
  }
  if (kind == MemKind::kCuda && dmabuf_fd >= 0) {
    job.md.dmabuf_fd = dmabuf_fd;  // the caller's: it stays theirs
    job.md.dmabuf_offset = dmabuf_offset;
  } else if (kind == MemKind::kCuda) {
    auto d = cuda_dmabuf_for_range(addr, len);
    if (d.ok()) {
      dmabuf = std::move(d.value());
      job.md.dmabuf_fd = dmabuf.fd;
      job.md.dmabuf_offset = dmabuf.offset;
    } else {
      PONTE_LOG_INFO("CUDA memory %p: no dmabuf (%s); registering through peer memory", addr, d.status().message());
    }
  }
  PONTE_RETURN_IF_ERROR(g->run_on_worker(job));
  PONTE_RETURN_IF_ERROR(job.st);
  MemoryRegion mr;
  mr.addr = addr;
  mr.len = len;
  mr.group = group;
  mr.kind = kind;
  mr.id = impl_->next_mr_id.fetch_add(1);
  mr.nic_mrs = std::move(job.out);
  return mr;
}

Status Engine::deregister(MemoryRegion& mr) {
  PONTE_GROUP_OR_RETURN(g, mr.group);
  if (mr.id == 0) return Status(Code::kInvalidArgument, "deregister: region is not registered");
  DeregisterJob job{g, mr.nic_mrs};
  PONTE_RETURN_IF_ERROR(g->run_on_worker(job));
  mr.id = 0;
  mr.nic_mrs.clear();
  return Status::Ok();
}

// ---- validation shared by the operations

static bool range_ok(size_t off, size_t len, size_t total) { return off <= total && len <= total - off; }

static Status check_local(const LocalSlice& s, int group) {
  if (!s.mr || s.mr->id == 0) return Status(Code::kInvalidArgument, "local memory is not registered");
  if (s.mr->group != group)
    return Status(Code::kInvalidArgument, "local memory is registered with group %d, not %d", s.mr->group, group);
  if (!range_ok(s.offset, s.len, s.mr->len))
    return Status(Code::kInvalidArgument, "local range [%zu, +%zu) outside the %zu-byte region", s.offset, s.len, s.mr->len);
  return Status::Ok();
}

static Status check_remote(const RemoteRegion& r, size_t off, size_t len) {
  if (r.nics == 0 || r.nics > kMaxNicsPerGroup) return Status(Code::kInvalidArgument, "remote region has no keys");
  if (!range_ok(off, len, r.len))
    return Status(Code::kInvalidArgument, "remote range [%zu, +%zu) outside the %llu-byte region", off, len,
                  static_cast<unsigned long long>(r.len));
  return Status::Ok();
}

static Status check_peer(const NicGroup* g, PeerId p) {
  if (!g->peer_exists(p)) return Status(Code::kInvalidArgument, "unknown peer %u", p);
  if (g->peer_closed(p)) return Status(Code::kPeerDead, "peer %u is dead or closed", p);
  return Status::Ok();
}

// One write (striped over the peer's NICs unless whole), checked and submitted.
static Status submit_write(NicGroup* g, int group, PeerId peer, const LocalSlice& src, const RemoteRegion& dst,
                           size_t dst_offset, const uint32_t* imm, bool whole, bool behind, Notify done) {
  PONTE_RETURN_IF_ERROR(check_peer(g, peer));
  PONTE_RETURN_IF_ERROR(check_local(src, group));
  PONTE_RETURN_IF_ERROR(check_remote(dst, dst_offset, src.len));
  Op op;
  op.type = Op::kWrite;
  op.whole = whole;
  op.behind = behind;
  op.peer = peer;
  op.mr = src.mr;
  op.offset = src.offset;
  op.len = src.len;
  op.remote = dst;
  op.remote_offset = dst_offset;
  op.has_imm = imm != nullptr;
  op.imm = imm ? *imm : 0;
  op.done = done;
  return g->submit(op);
}

Status Engine::write(int group, PeerId peer, const LocalSlice& src, const RemoteRegion& dst, size_t dst_offset,
                     const uint32_t* imm, Notify done) {
  PONTE_GROUP_OR_RETURN(g, group);
  return submit_write(g, group, peer, src, dst, dst_offset, imm, false, false, done);
}

Status Engine::write_imm_whole(int group, PeerId peer, const LocalSlice& src, const RemoteRegion& dst,
                               size_t dst_offset, uint32_t imm, Notify done, bool behind) {
  PONTE_GROUP_OR_RETURN(g, group);
  return submit_write(g, group, peer, src, dst, dst_offset, &imm, true, behind, done);
}

Status Engine::write_whole(int group, PeerId peer, const LocalSlice& src, const RemoteRegion& dst,
                           size_t dst_offset, Notify done, bool behind) {
  PONTE_GROUP_OR_RETURN(g, group);
  return submit_write(g, group, peer, src, dst, dst_offset, nullptr, true, behind, done);
}

// Engine::read and read_each_nic: count 0 reads through one NIC, else through that many.
static Status submit_read(NicGroup* g, int group, PeerId peer, const LocalSlice& dst, const RemoteRegion& src,
                          size_t src_offset, uint32_t count, Notify done) {
  PONTE_RETURN_IF_ERROR(check_peer(g, peer));
  PONTE_RETURN_IF_ERROR(check_local(dst, group));
  PONTE_RETURN_IF_ERROR(check_remote(src, src_offset, dst.len));
  Op op;
  op.type = Op::kRead;
  op.peer = peer;
  op.mr = dst.mr;
  op.offset = dst.offset;
  op.len = dst.len;
  op.remote = src;
  op.remote_offset = src_offset;
  op.count = count;
  op.done = done;
  return g->submit(op);
}

Status Engine::read(int group, PeerId peer, const LocalSlice& dst, const RemoteRegion& src, size_t src_offset,
                    Notify done) {
  PONTE_GROUP_OR_RETURN(g, group);
  return submit_read(g, group, peer, dst, src, src_offset, 0, done);
}

Status Engine::read_each_nic(int group, PeerId peer, const LocalSlice& dst, const RemoteRegion& src,
                             size_t src_offset, int nics, Notify done) {
  PONTE_GROUP_OR_RETURN(g, group);
  if (nics < 1 || nics > kMaxNicsPerGroup)
    return Status(Code::kInvalidArgument, "read_each_nic: %d NICs (1..%d)", nics, kMaxNicsPerGroup);
  const int n = std::min<int>({nics, g->nic_count(), static_cast<int>(src.nics)});
  return submit_read(g, group, peer, dst, src, src_offset, static_cast<uint32_t>(std::max(n, 1)), done);
}

uint64_t Engine::reads_posted(int group, int nic) const {
  const NicGroup* g = impl_->group(group);
  return g ? g->reads_posted(nic) : 0;
}

Status Engine::paged_write(int group, PeerId peer, const MemoryRegion& src, std::span<const uint32_t> src_pages,
                           const RemoteRegion& dst, std::span<const uint32_t> dst_pages, size_t page_size,
                           const uint32_t* imm, Notify done) {
  PONTE_GROUP_OR_RETURN(g, group);
  PONTE_RETURN_IF_ERROR(check_peer(g, peer));
  if (src_pages.size() != dst_pages.size())
    return Status(Code::kInvalidArgument, "paged_write: %zu source pages but %zu destination pages", src_pages.size(), dst_pages.size());
  if (page_size == 0) return Status(Code::kInvalidArgument, "paged_write: page size 0");
  if (src_pages.size() > 0xffffffffu) return Status(Code::kInvalidArgument, "paged_write: too many pages");
  PONTE_RETURN_IF_ERROR(check_local(LocalSlice{&src, 0, 0}, group));
  PONTE_RETURN_IF_ERROR(check_remote(dst, 0, 0));
  for (size_t i = 0; i < src_pages.size(); i++) {
    if (!range_ok(static_cast<size_t>(src_pages[i]) * page_size, page_size, src.len))
      return Status(Code::kInvalidArgument, "paged_write: source page %u outside the region", src_pages[i]);
    if (!range_ok(static_cast<size_t>(dst_pages[i]) * page_size, page_size, dst.len))
      return Status(Code::kInvalidArgument, "paged_write: destination page %u outside the region", dst_pages[i]);
  }
  Op op;
  op.type = Op::kPaged;
  op.peer = peer;
  op.mr = &src;
  op.src_pages = src_pages.data();
  op.dst_pages = dst_pages.data();
  op.count = static_cast<uint32_t>(src_pages.size());
  op.page_size = page_size;
  op.remote = dst;
  op.has_imm = imm != nullptr;
  op.imm = imm ? *imm : 0;
  op.done = done;
  return g->submit(op);
}

Status Engine::scatter(int group, const MemoryRegion& src, std::span<const ScatterTarget> targets,
                       const uint32_t* imm, Notify done) {
  PONTE_GROUP_OR_RETURN(g, group);
  PONTE_RETURN_IF_ERROR(check_local(LocalSlice{&src, 0, 0}, group));
  if (targets.size() > 0xffffffffu) return Status(Code::kInvalidArgument, "scatter: too many targets");
  for (const auto& t : targets) {
    PONTE_RETURN_IF_ERROR(check_peer(g, t.peer));
    if (!t.dst) return Status(Code::kInvalidArgument, "scatter: target without a destination region");
    PONTE_RETURN_IF_ERROR(check_local(LocalSlice{&src, t.src_offset, t.len}, group));
    PONTE_RETURN_IF_ERROR(check_remote(*t.dst, t.dst_offset, t.len));
  }
  Op op;
  op.type = Op::kScatter;
  op.mr = &src;
  op.targets = targets.data();
  op.count = static_cast<uint32_t>(targets.size());
  op.has_imm = imm != nullptr;
  op.imm = imm ? *imm : 0;
  op.done = done;
  return g->submit(op);
}

Status Engine::imm(int group, PeerId peer, uint32_t value, Notify done) {
  PONTE_GROUP_OR_RETURN(g, group);
  PONTE_RETURN_IF_ERROR(check_peer(g, peer));
  Op op;
  op.type = Op::kImm;
  op.peer = peer;
  op.imm = value;
  op.has_imm = true;
  op.done = done;
  return g->submit(op);
}

Status Engine::barrier(int group, std::span<const PeerId> peers, uint32_t value, Notify done) {
  PONTE_GROUP_OR_RETURN(g, group);
  for (PeerId p : peers) PONTE_RETURN_IF_ERROR(check_peer(g, p));
  Op op;
  op.type = Op::kBarrier;
  op.peers = peers.data();
  op.count = static_cast<uint32_t>(peers.size());
  op.imm = value;
  op.has_imm = true;
  op.done = done;
  return g->submit(op);
}

Status Engine::send(int group, PeerId peer, const LocalSlice& src, Notify done) {
  PONTE_GROUP_OR_RETURN(g, group);
  PONTE_RETURN_IF_ERROR(check_peer(g, peer));
  PONTE_RETURN_IF_ERROR(check_local(src, group));
  if (src.len > g->config().recv_buf_size)
    return Status(Code::kInvalidArgument, "send of %zu bytes: the receive buffers hold %u (PONTE_RECV_SIZE)", src.len,
                  g->config().recv_buf_size);
  Op op;
  op.type = Op::kSend;
  op.peer = peer;
  op.mr = src.mr;
  op.offset = src.offset;
  op.len = src.len;
  op.done = done;
  return g->submit(op);
}

namespace {
struct HandlerJob {
  NicGroup* g;
  RecvHandler fn;
  void* arg;
  void run() { g->set_recv_handler(fn, arg); }
};
}  // namespace

void Engine::set_recv_handler(int group, RecvHandler fn, void* arg) {
  NicGroup* g = impl_->group(group);
  if (!g) return;
  HandlerJob job{g, fn, arg};
  Status st = g->run_on_worker(job);
  if (!st.ok()) PONTE_LOG_ERROR("set_recv_handler: %s", st.message());
}

Status Engine::expect_imm(int group, uint32_t value, uint32_t count, PeerId from, Notify done, uint32_t timeout_ms) {
  PONTE_GROUP_OR_RETURN(g, group);
  if (count == 0) return Status(Code::kInvalidArgument, "expect_imm: count 0");
  if (from != kAnyPeer && !g->peer_exists(from)) return Status(Code::kInvalidArgument, "expect_imm: unknown peer %u", from);
  Op op;
  op.type = Op::kExpect;
  op.imm = value;
  op.count = count;
  op.peer = from;
  op.timeout_ms = timeout_ms;
  op.done = done;
  return g->submit(op);
}

namespace {
void cancel_waiters(void* group) {
  static_cast<NicGroup*>(group)->imm_table().fail_all(
      Status(Code::kCancelled, "expect_imm: cancelled (the caller stopped waiting)"));
}
}  // namespace

Status Engine::cancel_expectations(int group) {
  PONTE_GROUP_OR_RETURN(g, group);
  Op op;  // behind every expectation submitted before it: the queue is in order
  op.type = Op::kCall;
  op.call = &cancel_waiters;
  op.call_arg = g;
  return g->submit(op);
}

bool Engine::progress(int group) {
  NicGroup* g = impl_->group(group);
  return g && g->progress();
}

bool Engine::start_submitted(int group) {
  NicGroup* g = impl_->group(group);
  return g && g->start_submitted();
}

bool Engine::polled_here(int group) const {
  NicGroup* g = impl_->group(group);
  return g && g->polled_here();
}

bool Engine::polling_posts(int group) const {
  NicGroup* g = impl_->group(group);
  return g && g->pollers_post();
}

void Engine::stop_polling(int group) {
  NicGroup* g = impl_->group(group);
  if (g) g->stop_polling();
}

uint32_t Engine::imm_arrived(int group, uint32_t value) const {
  NicGroup* g = impl_->group(group);
  return g ? g->imm_table().arrived(value) : 0;
}

void Engine::consume_imm(int group, uint32_t value, uint32_t n) {
  NicGroup* g = impl_->group(group);
  if (g) g->imm_table().consume(value, n);
}

uint32_t Engine::imms_per_write(int group, PeerId peer, size_t len) const {
  NicGroup* g = impl_->group(group);
  if (!g) return 0;
  return StripePlan::make(len, g->peer_nics(peer), g->config().stripe_min_bytes, g->peer_max_shard(peer)).shards;
}

}  // namespace ponte
