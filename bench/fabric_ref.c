// fabric-ref: the minimal raw libfabric program that ponte-bench is measured against: FI_EP_RDM
// writes, writes with immediate and an 8-byte write-imm ping-pong, both ends forked on loopback.
//
// One process forks the target; the two exchange endpoint addresses and memory keys over a
// socketpair, then the client drives each test and the target only polls its completion queue.
// Every wait is bounded (--timeout); a dead peer or a failed verification ends with a non-zero exit.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

enum op_kind { OP_WRITE, OP_WRITE_IMM, OP_LAT };
static const char* const op_names[] = {"write", "write-imm", "lat"};

#define MAX_SIZES 32
#define MAX_OPS 3
#define RX_CQ_DATA_RECVS 64

// Immediate values: the high byte says what the immediate is for.
#define IMM_VERIFY 0x01000000u
#define IMM_DATA 0x02000000u
#define IMM_DONE 0x03000000u
#define IMM_PING 0x04000000u
#define IMM_KIND_MASK 0xff000000u

struct options {
  char provider[128];
  enum op_kind ops[MAX_OPS];
  int nops;
  size_t sizes[MAX_SIZES];
  int nsizes;
  bool sizes_given;
  int window;
  long iters;  // 0: chosen per size
  bool json;
  bool delivery_complete;
  int timeout_s;
  bool quiet;
};

struct result {
  enum op_kind op;
  size_t size;
  long iters;
  double gbps, mops, lat_us;
  double cpu_ns_per_op;   // posting thread's CPU time inside the posting calls, per op
  double proc_ns_per_op;  // the whole client process's CPU time per op (posting + polling)
};

// ---------------------------------------------------------------------------------------------
// Small helpers: time, errors, the out-of-band channel.

static const char* g_role = "fabric-ref";
static int g_timeout_s = 60;

static void die(const char* fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", g_role);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(1);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int64_t cpu_ns(clockid_t clk) {
  struct timespec ts;
  clock_gettime(clk, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static pid_t g_child = -1;

// Describes how the forked peer ended, if it did.
static const char* child_state(void) {
  static char text[96];
  if (g_child <= 0) return "";
  int status = 0;
  pid_t r = 0;
  for (int i = 0; i < 50 && (r = waitpid(g_child, &status, WNOHANG)) == 0; i++) usleep(10 * 1000);
  if (r != g_child) return "";
  g_child = -1;
  if (WIFSIGNALED(status))
    snprintf(text, sizeof(text), " (the target process was killed by signal %d)", WTERMSIG(status));
  else
    snprintf(text, sizeof(text), " (the target process exited with status %d)", WEXITSTATUS(status));
  return text;
}

// The last line of defence against a call that never returns; re-armed per test.
static void on_watchdog(int sig) {
  (void)sig;
  static const char msg[] = "fabric-ref: watchdog: a test made no progress for 4 timeouts; giving up\n";
  ssize_t n = write(2, msg, sizeof(msg) - 1);
  (void)n;
  if (g_child > 0) kill(g_child, SIGKILL);
  _exit(1);
}

static void arm_watchdog(void) { alarm((unsigned)(4 * g_timeout_s + 30)); }

static void oob_write(int fd, const void* data, size_t len) {
  const char* p = data;
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) die("out-of-band send failed: %s%s", strerror(errno), child_state());
    p += n;
    len -= (size_t)n;
  }
}

// While an endpoint is open, waiting for the peer also drives its progress (manual-progress
// providers need CQ polls to answer the peer, e.g. a delivery-complete acknowledgement).
static void (*g_progress)(void) = NULL;

static void oob_read(int fd, void* data, size_t len, const char* what) {
  char* p = data;
  double deadline = now_s() + g_timeout_s;
  while (len > 0) {
    int left_ms = (int)((deadline - now_s()) * 1000);
    if (left_ms <= 0) die("timed out after %d s waiting for the peer's %s%s", g_timeout_s, what, child_state());
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    if (g_progress) g_progress();
    int r = poll(&pfd, 1, g_progress ? 0 : left_ms < 200 ? left_ms : 200);
    if (r < 0 && errno != EINTR) die("poll: %s", strerror(errno));
    if (r <= 0) continue;
    ssize_t n = recv(fd, p, len, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) die("the peer closed the out-of-band channel while we waited for its %s%s", what, child_state());
    if (n < 0) die("out-of-band recv failed: %s%s", strerror(errno), child_state());
    p += n;
    len -= (size_t)n;
  }
}

// Control messages: a fixed little struct, both ends are the same binary on one host.
struct ctrl {
  uint32_t kind;  // 'V' verify, 'M' measure, 'C' cpu phase, 'L' latency, 'Q' quit, 'R' ready, 'D' done, 'E' error
  uint32_t op;
  uint64_t size;
  uint64_t count;
  uint64_t seed;
  char text[96];
};

static void send_ctrl(int fd, uint32_t kind, uint32_t op, uint64_t size, uint64_t count, uint64_t seed,
                      const char* text) {
  struct ctrl c;
  memset(&c, 0, sizeof(c));
  c.kind = kind;
  c.op = op;
  c.size = size;
  c.count = count;
  c.seed = seed;
  if (text) snprintf(c.text, sizeof(c.text), "%s", text);
  oob_write(fd, &c, sizeof(c));
}

static struct ctrl recv_ctrl(int fd, const char* what) {
  struct ctrl c;
  oob_read(fd, &c, sizeof(c), what);
  c.text[sizeof(c.text) - 1] = 0;
  return c;
}

// The verification pattern: depends on the byte's offset and the test, so misplaced or stale
// bytes are caught.
static inline uint8_t pattern_byte(size_t i, uint64_t seed) {
  uint64_t x = (uint64_t)i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
  return (uint8_t)(x >> 56);
}

// ---------------------------------------------------------------------------------------------
// The endpoint.

struct endpoint {
  struct fi_info* info;
  struct fid_fabric* fabric;
  struct fid_domain* domain;
  struct fid_av* av;
  struct fid_cq* cq;
  struct fid_ep* ep;
  struct fid_mr* mr;
  void* desc;
  char* buf;
  size_t buf_len;
  bool virt_addr;
  bool delivery_complete;  // --delivery-complete: writes complete once placed at the target
  bool rx_cq_data;  // the provider wants a posted receive per remote CQ data
  fi_addr_t peer;
  uint64_t peer_base;  // what we pass as remote address of byte 0 of the peer's buffer
  uint64_t peer_key;

  // Local operation contexts: a free stack, so a context is never reused while in flight.
  struct fi_context2* tx_ctx;
  int* free_ctx;
  int nfree;
  int nctx;
  struct fi_context2 rx_ctx[RX_CQ_DATA_RECVS];

  // What polling has seen.
  uint64_t tx_done;
  uint64_t imm_count[8];  // per IMM kind (high byte), counts remote immediates
  uint32_t last_imm;
};

static void check(int ret, const char* what) {
  if (ret) die("%s failed: %s (%d)%s", what, fi_strerror(-ret), ret, child_state());
}

static bool is_loopback(const struct fi_info* fi) {
  if (!fi->src_addr) return true;
  if (fi->addr_format == FI_SOCKADDR_IN) {
    const struct sockaddr_in* sin = fi->src_addr;
    return (ntohl(sin->sin_addr.s_addr) >> 24) == 127;
  }
  if (fi->addr_format == FI_SOCKADDR_IN6) {
    const struct sockaddr_in6* sin6 = fi->src_addr;
    return IN6_IS_ADDR_LOOPBACK(&sin6->sin6_addr);
  }
  return true;  // not an IP address (shm's strings): not a network
}

static bool is_ipv4(const struct fi_info* fi) { return fi->addr_format == FI_SOCKADDR_IN; }

static void post_rx_cq_data(struct endpoint* e, int slot) {
  for (;;) {
    ssize_t r = fi_recv(e->ep, NULL, 0, NULL, FI_ADDR_UNSPEC, &e->rx_ctx[slot]);
    if (r == -FI_EAGAIN) {
      fi_cq_read(e->cq, NULL, 0);
      continue;
    }
    check((int)r, "fi_recv");
    return;
  }
}

static void open_endpoint(struct endpoint* e, const struct options* o, size_t buf_len, int nctx) {
  memset(e, 0, sizeof(*e));
  struct fi_info* hints = fi_allocinfo();
  if (!hints) die("fi_allocinfo: out of memory");
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_MSG | FI_SEND | FI_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  // Remote CQ data is asked for through its size: FI_REMOTE_CQ_DATA in caps fails fi_getinfo.
  hints->domain_attr->cq_data_size = 4;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->fabric_attr->prov_name = strdup(o->provider);
  struct fi_info* list = NULL;
  int ret = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &list);
  fi_freeinfo(hints);
  if (ret) die("fi_getinfo(provider '%s', FI_EP_RDM, RMA, cq_data_size 4) failed: %s (%d)", o->provider,
               fi_strerror(-ret), ret);
  // Loopback only: prefer IPv4 loopback, then any loopback; never a real network interface.
  struct fi_info* pick = NULL;
  for (struct fi_info* fi = list; fi && !pick; fi = fi->next)
    if (is_loopback(fi) && is_ipv4(fi)) pick = fi;
  for (struct fi_info* fi = list; fi && !pick; fi = fi->next)
    if (is_loopback(fi)) pick = fi;
  if (!pick) die("provider '%s' offers no loopback endpoint (set FI_TCP_IFACE=lo); refusing to use a network", o->provider);
  e->info = fi_dupinfo(pick);
  fi_freeinfo(list);

  uint64_t mr_mode = (uint64_t)e->info->domain_attr->mr_mode;
  e->virt_addr = (mr_mode & FI_MR_VIRT_ADDR) != 0;
  e->delivery_complete = o->delivery_complete;
  e->rx_cq_data = (e->info->mode & FI_RX_CQ_DATA) != 0;

  check(fi_fabric(e->info->fabric_attr, &e->fabric, NULL), "fi_fabric");
  check(fi_domain(e->fabric, e->info, &e->domain, NULL), "fi_domain");
  struct fi_av_attr av_attr = {.type = FI_AV_TABLE, .count = 4};
  check(fi_av_open(e->domain, &av_attr, &e->av, NULL), "fi_av_open");
  struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE, .size = 0};
  check(fi_cq_open(e->domain, &cq_attr, &e->cq, NULL), "fi_cq_open");
  check(fi_endpoint(e->domain, e->info, &e->ep, NULL), "fi_endpoint");
  check(fi_ep_bind(e->ep, &e->av->fid, 0), "fi_ep_bind(av)");
  check(fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
  check(fi_enable(e->ep), "fi_enable");

  e->buf_len = buf_len < 64 ? 64 : buf_len;
  e->buf = aligned_alloc(4096, (e->buf_len + 4095) / 4096 * 4096);
  if (!e->buf) die("cannot allocate %zu bytes", e->buf_len);
  memset(e->buf, 0, e->buf_len);
  // Without FI_MR_PROV_KEY the application picks the key, unique within the domain; one MR here.
  uint64_t requested_key = (mr_mode & FI_MR_PROV_KEY) ? 0 : 0x5eed;
  check(fi_mr_reg(e->domain, e->buf, e->buf_len,
                  FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ | FI_SEND | FI_RECV, 0,
                  requested_key, 0, &e->mr, NULL),
        "fi_mr_reg");
  if (mr_mode & FI_MR_ENDPOINT) {
    check(fi_mr_bind(e->mr, &e->ep->fid, 0), "fi_mr_bind");
    check(fi_mr_enable(e->mr), "fi_mr_enable");
  }
  e->desc = fi_mr_desc(e->mr);

  e->nctx = nctx;
  e->tx_ctx = calloc((size_t)nctx, sizeof(*e->tx_ctx));
  e->free_ctx = calloc((size_t)nctx, sizeof(int));
  if (!e->tx_ctx || !e->free_ctx) die("out of memory");
  for (int i = 0; i < nctx; i++) e->free_ctx[i] = nctx - 1 - i;
  e->nfree = nctx;
  if (e->rx_cq_data)
    for (int i = 0; i < RX_CQ_DATA_RECVS; i++) post_rx_cq_data(e, i);
}

static void close_endpoint(struct endpoint* e) {
  if (e->mr) fi_close(&e->mr->fid);
  if (e->ep) fi_close(&e->ep->fid);
  if (e->cq) fi_close(&e->cq->fid);
  if (e->av) fi_close(&e->av->fid);
  if (e->domain) fi_close(&e->domain->fid);
  if (e->fabric) fi_close(&e->fabric->fid);
  if (e->info) fi_freeinfo(e->info);
  free(e->buf);
  free(e->tx_ctx);
  free(e->free_ctx);
}

// Endpoint address, memory key and base, both ways.
static void exchange(struct endpoint* e, int fd) {
  char name[256];
  size_t name_len = sizeof(name);
  check(fi_getname(&e->ep->fid, name, &name_len), "fi_getname");
  uint64_t mine[3] = {name_len, fi_mr_key(e->mr), e->virt_addr ? (uint64_t)(uintptr_t)e->buf : 0};
  oob_write(fd, mine, sizeof(mine));
  oob_write(fd, name, name_len);
  uint64_t theirs[3];
  oob_read(fd, theirs, sizeof(theirs), "endpoint address");
  if (theirs[0] == 0 || theirs[0] > sizeof(name)) die("peer sent a bad address length %" PRIu64, theirs[0]);
  char peer_name[256];
  oob_read(fd, peer_name, (size_t)theirs[0], "endpoint address");
  e->peer_key = theirs[1];
  e->peer_base = theirs[2];
  int n = fi_av_insert(e->av, peer_name, 1, &e->peer, 0, NULL);
  if (n != 1) die("fi_av_insert failed: %d", n);
}

// Polls the CQ once: counts local completions and remote immediates. Returns entries seen.
static int poll_cq(struct endpoint* e) {
  struct fi_cq_data_entry ent[16];
  ssize_t n = fi_cq_read(e->cq, ent, 16);
  if (n == -FI_EAGAIN) return 0;
  if (n == -FI_EAVAIL) {
    struct fi_cq_err_entry err;
    memset(&err, 0, sizeof(err));
    fi_cq_readerr(e->cq, &err, 0);
    die("completion error: %s (prov errno %d: %s)%s", fi_strerror(err.err), err.prov_errno,
        fi_cq_strerror(e->cq, err.prov_errno, err.err_data, NULL, 0), child_state());
  }
  if (n < 0) die("fi_cq_read: %s", fi_strerror((int)-n));
  for (ssize_t i = 0; i < n; i++) {
    // Local completions are told apart by their context, not their flags.
    struct fi_context2* ctx = ent[i].op_context;
    if (ctx >= e->tx_ctx && ctx < e->tx_ctx + e->nctx) {
      e->free_ctx[e->nfree++] = (int)(ctx - e->tx_ctx);
      e->tx_done++;
      continue;
    }
    if (ent[i].flags & FI_REMOTE_CQ_DATA) {
      uint32_t imm = (uint32_t)ent[i].data;
      e->imm_count[(imm >> 24) & 7]++;
      e->last_imm = imm;
    }
    if (ctx >= e->rx_ctx && ctx < e->rx_ctx + RX_CQ_DATA_RECVS) post_rx_cq_data(e, (int)(ctx - e->rx_ctx));
  }
  return (int)n;
}

// Posts one write (with imm when has_imm); false when the queue is full (poll and retry).
static bool post_write(struct endpoint* e, size_t len, bool has_imm, uint32_t imm) {
  if (e->nfree == 0) return false;
  int slot = e->free_ctx[e->nfree - 1];
  ssize_t r;
  if (e->delivery_complete && len > 0) {
    // Completion only once the data is in the target's memory (what a later immediate on
    // another connection may rely on); the default is transmit-complete. Not for a lone
    // immediate: shm (1.17) never completes a zero-byte delivery-complete write.
    struct iovec iov = {.iov_base = e->buf, .iov_len = len};
    void* desc = e->desc;
    struct fi_rma_iov rma = {.addr = e->peer_base, .len = len, .key = e->peer_key};
    struct fi_msg_rma msg = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = e->peer,
                             .rma_iov = &rma, .rma_iov_count = 1, .context = &e->tx_ctx[slot],
                             .data = imm};
    r = fi_writemsg(e->ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE | (has_imm ? FI_REMOTE_CQ_DATA : 0));
  } else if (has_imm)
    r = fi_writedata(e->ep, e->buf, len, e->desc, imm, e->peer, e->peer_base, e->peer_key, &e->tx_ctx[slot]);
  else
    r = fi_write(e->ep, e->buf, len, e->desc, e->peer, e->peer_base, e->peer_key, &e->tx_ctx[slot]);
  if (r == -FI_EAGAIN) return false;
  check((int)r, has_imm ? "fi_writedata" : "fi_write");
  e->nfree--;
  return true;
}

// Bounded busy wait: polls until *counter reaches target.
static void wait_count(struct endpoint* e, const uint64_t* counter, uint64_t target, const char* what) {
  double deadline = now_s() + g_timeout_s;
  unsigned spins = 0;
  while (*counter < target) {
    poll_cq(e);
    if ((++spins & 1023) == 0 && now_s() > deadline)
      die("timed out after %d s waiting for %s (%" PRIu64 " of %" PRIu64 ")%s", g_timeout_s, what, *counter,
          target, child_state());
  }
}

static struct endpoint* g_progress_ep = NULL;
static void progress_endpoint(void) { poll_cq(g_progress_ep); }

// Waits until every posted write has completed (all contexts are back).
static void drain(struct endpoint* e) {
  double deadline = now_s() + g_timeout_s;
  while (e->nfree < e->nctx) {
    poll_cq(e);
    if (now_s() > deadline) die("timed out draining %d outstanding writes%s", e->nctx - e->nfree, child_state());
  }
}

static void post_blocking(struct endpoint* e, size_t len, bool has_imm, uint32_t imm) {
  double deadline = now_s() + g_timeout_s;
  while (!post_write(e, len, has_imm, imm)) {
    poll_cq(e);
    if (now_s() > deadline) die("timed out posting a write%s", child_state());
  }
}

// Keeps `window` writes in flight until n have completed; returns the elapsed seconds.
static double run_window(struct endpoint* e, size_t size, uint64_t n, int window, bool has_imm, uint32_t imm) {
  uint64_t start_done = e->tx_done, posted = 0;
  double t0 = now_s(), deadline = t0 + g_timeout_s;
  unsigned spins = 0;
  while (e->tx_done - start_done < n) {
    while (posted < n && posted - (e->tx_done - start_done) < (uint64_t)window) {
      if (!post_write(e, size, has_imm, imm)) break;
      posted++;
    }
    poll_cq(e);
    if ((++spins & 1023) == 0 && now_s() > deadline)
      die("timed out after %d s: %" PRIu64 " of %" PRIu64 " writes completed%s", g_timeout_s,
          e->tx_done - start_done, n, child_state());
  }
  return now_s() - t0;
}

// ---------------------------------------------------------------------------------------------
// The two roles.

static uint32_t kind_index(uint32_t imm_kind) { return (imm_kind >> 24) & 7; }

static void target_main(int fd, const struct options* o, size_t max_size) {
  g_role = "fabric-ref target";
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  struct endpoint e;
  open_endpoint(&e, o, max_size, 8);
  exchange(&e, fd);
  g_progress_ep = &e;
  g_progress = progress_endpoint;
  for (;;) {
    struct ctrl c = recv_ctrl(fd, "next command");
    arm_watchdog();
    if (c.kind == 'Q') break;
    if (c.kind == 'V') {
      memset(e.buf, 0, c.size);
      uint64_t before = e.imm_count[kind_index(IMM_VERIFY)];
      send_ctrl(fd, 'R', 0, 0, 0, 0, NULL);
      wait_count(&e, &e.imm_count[kind_index(IMM_VERIFY)], before + 1, "the verification write's immediate");
      char text[96] = "";
      for (size_t i = 0; i < c.size; i++) {
        if ((uint8_t)e.buf[i] != pattern_byte(i, c.seed)) {
          snprintf(text, sizeof(text), "byte %zu of %" PRIu64 " is 0x%02x, expected 0x%02x", i, c.size,
                   (uint8_t)e.buf[i], pattern_byte(i, c.seed));
          break;
        }
      }
      send_ctrl(fd, text[0] ? 'E' : 'D', 0, 0, 0, 0, text);
    } else if (c.kind == 'M' || c.kind == 'C') {
      // Bandwidth: write-imm counts every arrival; plain write ends with one IMM_DONE.
      bool imm_each = c.op == OP_WRITE_IMM;
      uint32_t kind = imm_each ? IMM_DATA : IMM_DONE;
      uint64_t before = e.imm_count[kind_index(kind)];
      send_ctrl(fd, 'R', 0, 0, 0, 0, NULL);
      wait_count(&e, &e.imm_count[kind_index(kind)], before + (imm_each ? c.count : 1), "the writes' immediates");
      send_ctrl(fd, 'D', 0, 0, 0, 0, NULL);
    } else if (c.kind == 'L') {
      uint64_t* pings = &e.imm_count[kind_index(IMM_PING)];
      uint64_t base = *pings;
      send_ctrl(fd, 'R', 0, 0, 0, 0, NULL);
      for (uint64_t i = 1; i <= c.count; i++) {
        wait_count(&e, pings, base + i, "a ping");
        post_blocking(&e, c.size, true, IMM_PING);
      }
      drain(&e);
      send_ctrl(fd, 'D', 0, 0, 0, 0, NULL);
    } else {
      die("unknown command %u", c.kind);
    }
  }
  g_progress = NULL;
  close_endpoint(&e);
}

static long default_iters(enum op_kind op, size_t size) {
  if (op == OP_LAT) return 2000;
  long n = (long)((2ull << 30) / (size ? size : 1));
  if (n > 20000) n = 20000;
  if (n < 200) n = 200;
  return n;
}

static void client_measure(struct endpoint* e, int fd, const struct options* o, enum op_kind op, size_t size,
                           uint64_t seed, struct result* r) {
  arm_watchdog();
  r->op = op;
  r->size = size;
  long iters = o->iters > 0 ? o->iters : default_iters(op, size);
  r->iters = iters;
  if (op == OP_LAT) {
    long warm = iters / 10 < 100 ? iters / 10 : 100;
    uint64_t* pongs = &e->imm_count[kind_index(IMM_PING)];
    send_ctrl(fd, 'L', op, size, (uint64_t)(iters + warm), 0, NULL);
    struct ctrl c = recv_ctrl(fd, "latency ready");
    if (c.kind != 'R') die("target refused the latency test: %s", c.text);
    uint64_t base = *pongs;
    double t0 = 0;
    for (long i = 0; i < iters + warm; i++) {
      if (i == warm) t0 = now_s();
      post_blocking(e, size, true, IMM_PING);
      wait_count(e, pongs, base + (uint64_t)i + 1, "a pong");
    }
    double dt = now_s() - t0;
    c = recv_ctrl(fd, "latency done");
    drain(e);
    r->lat_us = dt / (double)iters / 2 * 1e6;
    r->mops = (double)iters / dt / 1e6;
    r->gbps = (double)size * (double)iters / dt / 1e9;
    r->cpu_ns_per_op = r->proc_ns_per_op = -1;
    return;
  }

  bool imm_each = op == OP_WRITE_IMM;
  // 1. Verify the data once: a pattern, one write with imm, the target checks every byte.
  for (size_t i = 0; i < size; i++) e->buf[i] = (char)pattern_byte(i, seed);
  send_ctrl(fd, 'V', op, size, 1, seed, NULL);
  struct ctrl c = recv_ctrl(fd, "verify ready");
  uint64_t done0 = e->tx_done;
  post_blocking(e, size, true, IMM_VERIFY);
  wait_count(e, &e->tx_done, done0 + 1, "the verification write");
  c = recv_ctrl(fd, "verification result");
  if (c.kind != 'D') die("VERIFY FAILED for %s of %zu bytes: %s", op_names[op], size, c.text);

  // 2. Bandwidth: `window` writes in flight, warm-up first.
  long warm = iters / 10 < 64 ? iters / 10 : 64;
  send_ctrl(fd, 'M', op, size, (uint64_t)(iters + warm), 0, NULL);
  c = recv_ctrl(fd, "measure ready");
  run_window(e, size, (uint64_t)warm, o->window, imm_each, IMM_DATA);
  double dt = run_window(e, size, (uint64_t)iters, o->window, imm_each, IMM_DATA);
  if (!imm_each) post_blocking(e, 0, true, IMM_DONE);
  c = recv_ctrl(fd, "measure done");
  drain(e);
  r->gbps = (double)size * (double)iters / dt / 1e9;
  r->mops = (double)iters / dt / 1e6;
  r->lat_us = dt / (double)iters * o->window * 1e6;  // time each write spends in flight (Little)

  // 3. CPU per posted op: bursts of `window` posts back to back, the posting measured alone.
  uint64_t n = (uint64_t)((256ull << 20) / (size ? size : 1));
  if (n > 4000) n = 4000;
  if (n > (uint64_t)iters) n = (uint64_t)iters;
  if (n < (uint64_t)o->window) n = (uint64_t)o->window;
  n = (n / (uint64_t)o->window) * (uint64_t)o->window;
  send_ctrl(fd, 'C', op, size, n, 0, NULL);
  c = recv_ctrl(fd, "cpu phase ready");
  int64_t clock_cost = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
  clock_cost = cpu_ns(CLOCK_THREAD_CPUTIME_ID) - clock_cost;
  int64_t post_ns = 0;
  int64_t p0 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID);
  for (uint64_t done = 0; done < n; done += (uint64_t)o->window) {
    uint64_t base = e->tx_done;
    int64_t t0 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
    for (int i = 0; i < o->window; i++) post_blocking(e, size, imm_each, IMM_DATA);
    post_ns += cpu_ns(CLOCK_THREAD_CPUTIME_ID) - t0 - clock_cost;
    wait_count(e, &e->tx_done, base + (uint64_t)o->window, "a burst of writes");
  }
  int64_t p1 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID);
  if (!imm_each) post_blocking(e, 0, true, IMM_DONE);
  c = recv_ctrl(fd, "cpu phase done");
  drain(e);
  r->cpu_ns_per_op = (double)post_ns / (double)n;
  r->proc_ns_per_op = (double)(p1 - p0) / (double)n;
}

static void print_results(const struct options* o, const struct result* res, int nres) {
  if (o->json) {
    printf("{\"tool\":\"fabric-ref\",\"provider\":\"%s\",\"results\":[", o->provider);
    for (int i = 0; i < nres; i++) {
      const struct result* r = &res[i];
      printf("%s{\"op\":\"%s\",\"size\":%zu,\"window\":%d,\"nics\":1,\"iters\":%ld,\"GBps\":%.4f,"
             "\"Mops\":%.4f,\"lat_us\":%.3f,\"cpu_ns_per_op\":%.1f,\"proc_ns_per_op\":%.1f}",
             i ? "," : "", op_names[r->op], r->size, r->op == OP_LAT ? 1 : o->window, r->iters, r->gbps,
             r->mops, r->lat_us, r->cpu_ns_per_op, r->proc_ns_per_op);
    }
    printf("]}\n");
    return;
  }
  printf("fabric-ref: raw libfabric FI_EP_RDM, provider %s, loopback, window %d%s\n", o->provider, o->window,
         o->delivery_complete ? ", FI_DELIVERY_COMPLETE" : "");
  printf("%-10s %10s %11s %10s %12s %10s %11s %12s\n", "op", "#bytes", "#iterations", "BW[GB/s]", "Mops",
         "lat[us]", "ns/op(cpu)", "ns/op(proc)");
  for (int i = 0; i < nres; i++) {
    const struct result* r = &res[i];
    char cpu[32] = "-", proc[32] = "-";
    if (r->cpu_ns_per_op >= 0) snprintf(cpu, sizeof(cpu), "%.0f", r->cpu_ns_per_op);
    if (r->proc_ns_per_op >= 0) snprintf(proc, sizeof(proc), "%.0f", r->proc_ns_per_op);
    printf("%-10s %10zu %11ld %10.3f %12.4f %10.2f %11s %12s\n", op_names[r->op], r->size, r->iters, r->gbps,
           r->mops, r->lat_us, cpu, proc);
  }
  fflush(stdout);
}

// ---------------------------------------------------------------------------------------------
// Command line.

static bool parse_size(const char* s, size_t* out) {
  char* end = NULL;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s) return false;
  unsigned long long mult = 1;
  if (*end == 'k' || *end == 'K') mult = 1ull << 10, end++;
  else if (*end == 'm' || *end == 'M') mult = 1ull << 20, end++;
  else if (*end == 'g' || *end == 'G') mult = 1ull << 30, end++;
  if (*end == 'b' || *end == 'B') end++;
  if (*end) return false;
  *out = (size_t)(v * mult);
  return true;
}

static void usage(int code) {
  fprintf(code ? stderr : stdout,
          "usage: fabric-ref [--provider P] [--op write|write-imm|lat[,...]] [--sizes 64k,1m,8m]\n"
          "                  [--window N] [--iters N] [--timeout S] [--delivery-complete] [--json]\n"
          "The minimal raw libfabric (FI_EP_RDM) program ponte-bench is compared with. It forks its\n"
          "peer and runs both ends on loopback. Defaults: provider tcp;ofi_rxm, op write,lat,\n"
          "sizes 64k,1m,8m (lat: 8), window 16, iterations chosen per size. --delivery-complete posts\n"
          "every write with FI_DELIVERY_COMPLETE instead of the provider's default completion.\n");
  exit(code);
}

static void parse_args(int argc, char** argv, struct options* o) {
  memset(o, 0, sizeof(*o));
  snprintf(o->provider, sizeof(o->provider), "tcp;ofi_rxm");
  o->window = 16;
  o->timeout_s = 60;
  o->ops[0] = OP_WRITE;
  o->ops[1] = OP_LAT;
  o->nops = 2;
  o->sizes[0] = 64 << 10;
  o->sizes[1] = 1 << 20;
  o->sizes[2] = 8 << 20;
  o->nsizes = 3;
  for (int i = 1; i < argc; i++) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    bool takes = true;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) usage(0);
    if (!strcmp(a, "--json")) {
      o->json = true;
      takes = false;
    } else if (!strcmp(a, "--delivery-complete")) {
      o->delivery_complete = true;
      takes = false;
    } else if (!v) {
      fprintf(stderr, "fabric-ref: %s needs a value\n", a);
      usage(2);
    } else if (!strcmp(a, "--provider")) {
      snprintf(o->provider, sizeof(o->provider), "%s", v);
    } else if (!strcmp(a, "--op")) {
      o->nops = 0;
      char tmp[128];
      snprintf(tmp, sizeof(tmp), "%s", v);
      for (char* save = NULL, *t = strtok_r(tmp, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int k = -1;
        for (int j = 0; j < 3; j++)
          if (!strcmp(t, op_names[j])) k = j;
        if (k < 0 || o->nops == MAX_OPS) {
          fprintf(stderr, "fabric-ref: bad --op '%s' (write, write-imm, lat)\n", t);
          usage(2);
        }
        o->ops[o->nops++] = (enum op_kind)k;
      }
    } else if (!strcmp(a, "--sizes")) {
      o->nsizes = 0;
      o->sizes_given = true;
      char tmp[512];
      snprintf(tmp, sizeof(tmp), "%s", v);
      for (char* save = NULL, *t = strtok_r(tmp, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (o->nsizes == MAX_SIZES || !parse_size(t, &o->sizes[o->nsizes])) {
          fprintf(stderr, "fabric-ref: bad size '%s'\n", t);
          usage(2);
        }
        if (o->sizes[o->nsizes] == 0 || o->sizes[o->nsizes] > (1ull << 30)) {
          fprintf(stderr, "fabric-ref: size %s is not in 1 byte .. 1 GiB\n", t);
          usage(2);
        }
        o->nsizes++;
      }
    } else if (!strcmp(a, "--window")) {
      o->window = atoi(v);
      if (o->window < 1 || o->window > 4096) {
        fprintf(stderr, "fabric-ref: --window must be 1..4096\n");
        usage(2);
      }
    } else if (!strcmp(a, "--iters")) {
      o->iters = atol(v);
      if (o->iters < 1) {
        fprintf(stderr, "fabric-ref: --iters must be positive\n");
        usage(2);
      }
    } else if (!strcmp(a, "--timeout")) {
      o->timeout_s = atoi(v);
      if (o->timeout_s < 1) usage(2);
    } else {
      fprintf(stderr, "fabric-ref: unknown option %s\n", a);
      usage(2);
    }
    if (takes) i++;
  }
  if (o->nsizes == 0) usage(2);
}

int main(int argc, char** argv) {
  struct options o;
  parse_args(argc, argv, &o);
  g_timeout_s = o.timeout_s;
  setvbuf(stdout, NULL, _IOLBF, 0);
  // Loopback only: the tcp provider must bind lo; never an interface that leaves the host.
  setenv("FI_TCP_IFACE", "lo", 0);
  signal(SIGPIPE, SIG_IGN);
  signal(SIGALRM, on_watchdog);
  arm_watchdog();

  size_t max_size = 8;
  for (int i = 0; i < o.nsizes; i++)
    if (o.sizes[i] > max_size) max_size = o.sizes[i];

  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) die("socketpair: %s", strerror(errno));
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) die("fork: %s", strerror(errno));
  if (pid == 0) {
    close(sv[0]);
    target_main(sv[1], &o, max_size);
    close(sv[1]);
    _exit(0);
  }
  g_child = pid;
  close(sv[1]);
  int fd = sv[0];
  g_role = "fabric-ref client";

  struct endpoint e;
  open_endpoint(&e, &o, max_size, o.window + 4);
  exchange(&e, fd);
  g_progress_ep = &e;
  g_progress = progress_endpoint;

  struct result res[MAX_OPS * MAX_SIZES];
  int nres = 0;
  uint64_t seed = 1;
  for (int k = 0; k < o.nops; k++) {
    enum op_kind op = o.ops[k];
    if (op == OP_LAT && !o.sizes_given) {
      client_measure(&e, fd, &o, op, 8, seed++, &res[nres++]);
      continue;
    }
    for (int s = 0; s < o.nsizes; s++) client_measure(&e, fd, &o, op, o.sizes[s], seed++, &res[nres++]);
  }
  send_ctrl(fd, 'Q', 0, 0, 0, 0, NULL);

  // The target must end cleanly; bounded.
  int status = 0;
  double deadline = now_s() + 10;
  pid_t r = 0;
  while ((r = waitpid(pid, &status, WNOHANG)) == 0 && now_s() < deadline) usleep(10000);
  if (r == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    die("the target process did not exit within 10 s");
  }
  if (r < 0) die("waitpid: %s", strerror(errno));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) die("the target process failed (status 0x%x)", status);
  g_progress = NULL;
  close_endpoint(&e);
  close(fd);
  print_results(&o, res, nres);
  return 0;
}
