/* libponte-ficount.so: a counting stand-in for libfabric, for ponte-scale and ponte-soak (not part
 * of ponte). Point PONTE_FABRIC_LIB at it: it exports the six entry points ponte's loader binds
 * (fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric, fi_strerror, fi_version), forwards them to the
 * real libfabric (PONTE_FICOUNT_REAL, default libfabric.so.1), and wraps the ops tables of every
 * object made below a fabric so that it can count what is alive: fabrics, domains, endpoints,
 * address vectors and their entries, completion queues and memory registrations.
 * ponte_ficount_read() returns the counts; the programs find it with dlsym.
 *
 * How: everything else in libfabric's API is an inline call through an object's ops table, so the
 * wrapper replaces the table pointer of each object it sees created with a copy whose creating
 * and closing entries count and then call the provider's own. The copy lives beside the object
 * (one allocation per object, freed when the provider's close succeeds). Objects a provider makes
 * for itself (rxm's inner tcp endpoints) never pass through here: they show up as descriptors. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { kFabric, kDomain, kEndpoint, kAv, kAvEntry, kCq, kMr, kMrBytes, kKinds };

static atomic_long g_live[kKinds];
static atomic_long g_made[kKinds];  /* ever created (or inserted), for rates */

/* The counts: live[kind] and made[kind] for kind 0..n-1 in the order fabric, domain, endpoint, av,
 * av entry, cq, mr, registered bytes. Returns the number of kinds. */
__attribute__((visibility("default"))) int ponte_ficount_read(long* live, long* made, int n) {
  for (int i = 0; i < n && i < kKinds; i++) {
    if (live) live[i] = atomic_load(&g_live[i]);
    if (made) made[i] = atomic_load(&g_made[i]);
  }
  return kKinds;
}

static void count_new(int kind, long n) {
  atomic_fetch_add(&g_live[kind], n);
  atomic_fetch_add(&g_made[kind], n);
}

/* ---- the real library ------------------------------------------------------------------------ */

static struct {
  int (*getinfo)(uint32_t, const char*, const char*, uint64_t, const struct fi_info*, struct fi_info**);
  void (*freeinfo)(struct fi_info*);
  struct fi_info* (*dupinfo)(const struct fi_info*);
  int (*fabric)(struct fi_fabric_attr*, struct fid_fabric**, void*);
  const char* (*strerror)(int);
  uint32_t (*version)(void);
} real;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void load_real(void) {
  const char* path = getenv("PONTE_FICOUNT_REAL");
  void* h = dlopen(path && *path ? path : "libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "libponte-ficount: cannot load the real libfabric: %s\n", dlerror());
    return;
  }
  real.getinfo = (int (*)(uint32_t, const char*, const char*, uint64_t, const struct fi_info*,
                          struct fi_info**))dlsym(h, "fi_getinfo");
  real.freeinfo = (void (*)(struct fi_info*))dlsym(h, "fi_freeinfo");
  real.dupinfo = (struct fi_info * (*)(const struct fi_info*)) dlsym(h, "fi_dupinfo");
  real.fabric = (int (*)(struct fi_fabric_attr*, struct fid_fabric**, void*))dlsym(h, "fi_fabric");
  real.strerror = (const char* (*)(int))dlsym(h, "fi_strerror");
  real.version = (uint32_t(*)(void))dlsym(h, "fi_version");
}
static int ready(void) {
  pthread_once(&g_once, load_real);
  return real.getinfo && real.freeinfo && real.dupinfo && real.fabric && real.strerror && real.version;
}

/* ---- wrapped fid ops: counting close ------------------------------------------------------------ */

/* The copies an object's table pointers are moved to; the first member is what fid->ops points at. */
struct Wrap {
  struct fi_ops fid_ops;          /* must stay first: fid->ops == &w->fid_ops */
  const struct fi_ops* orig_fid;  /* the provider's */
  int kind;
  long av_entries;                /* kAv: entries inserted through it (leave with it) */
  long bytes;                     /* kMr: the bytes it registers */
  union {
    struct fi_ops_fabric fabric;
    struct fi_ops_domain domain;
    struct fi_ops_av av;
  } ops;
  const void* orig_ops;           /* the provider's object-specific table */
  struct fi_ops_mr mr;            /* kDomain: its MR table */
  const struct fi_ops_mr* orig_mr;
};

/* Copies a provider table (its own size, at most ours) and keeps the size the provider gave. */
#define COPY_TABLE(dst, src)                                               \
  do {                                                                     \
    memset(&(dst), 0, sizeof(dst));                                        \
    size_t n_ = (src)->size < sizeof(dst) ? (src)->size : sizeof(dst);     \
    memcpy(&(dst), (src), n_);                                             \
  } while (0)

static struct Wrap* wrap_of(const struct fid* fid) { return (struct Wrap*)(void*)fid->ops; }

static int counting_close(struct fid* fid) {
  struct Wrap* w = wrap_of(fid);
  const struct fi_ops* orig = w->orig_fid;
  fid->ops = (struct fi_ops*)orig;  /* the provider closes its own object as it made it */
  int rc = orig->close(fid);
  if (rc != 0) {
    fid->ops = &w->fid_ops;  /* still alive */
    return rc;
  }
  atomic_fetch_sub(&g_live[w->kind], 1);
  if (w->kind == kAv) atomic_fetch_sub(&g_live[kAvEntry], w->av_entries);
  if (w->kind == kMr) atomic_fetch_sub(&g_live[kMrBytes], w->bytes);
  free(w);
  return 0;
}

static struct Wrap* wrap_fid(struct fid* fid, int kind) {
  struct Wrap* w = calloc(1, sizeof(*w));
  if (!w) return NULL;  /* left unwrapped: counted as made, never as closed */
  COPY_TABLE(w->fid_ops, fid->ops);
  w->orig_fid = fid->ops;
  w->fid_ops.close = counting_close;
  w->kind = kind;
  fid->ops = &w->fid_ops;
  count_new(kind, 1);
  return w;
}

/* ---- address vectors ----------------------------------------------------------------------------- */

static const struct fi_ops_av* orig_av(struct fid_av* av) { return wrap_of(&av->fid)->orig_ops; }
static void av_inserted(struct fid_av* av, int rc) {
  if (rc > 0) {
    wrap_of(&av->fid)->av_entries += rc;  /* the endpoint's worker only: one thread per AV */
    count_new(kAvEntry, rc);
  }
}
static int av_insert(struct fid_av* av, const void* addr, size_t count, fi_addr_t* fi_addr,
                     uint64_t flags, void* context) {
  int rc = orig_av(av)->insert(av, addr, count, fi_addr, flags, context);
  av_inserted(av, rc);
  return rc;
}
static int av_insertsvc(struct fid_av* av, const char* node, const char* service, fi_addr_t* fi_addr,
                        uint64_t flags, void* context) {
  int rc = orig_av(av)->insertsvc(av, node, service, fi_addr, flags, context);
  av_inserted(av, rc);
  return rc;
}
static int av_remove(struct fid_av* av, fi_addr_t* fi_addr, size_t count, uint64_t flags) {
  int rc = orig_av(av)->remove(av, fi_addr, count, flags);
  if (rc == 0) {
    wrap_of(&av->fid)->av_entries -= (long)count;
    atomic_fetch_sub(&g_live[kAvEntry], (long)count);
  }
  return rc;
}

/* ---- domains: endpoints, AVs, CQs, MRs ------------------------------------------------------------ */

static const struct fi_ops_domain* orig_domain(struct fid_domain* d) {
  return wrap_of(&d->fid)->orig_ops;
}
static int dom_av_open(struct fid_domain* d, struct fi_av_attr* attr, struct fid_av** av, void* ctx) {
  int rc = orig_domain(d)->av_open(d, attr, av, ctx);
  if (rc == 0) {
    struct Wrap* w = wrap_fid(&(*av)->fid, kAv);
    if (w) {
      COPY_TABLE(w->ops.av, (*av)->ops);
      w->orig_ops = (*av)->ops;
      if (w->ops.av.insert) w->ops.av.insert = av_insert;
      if (w->ops.av.insertsvc) w->ops.av.insertsvc = av_insertsvc;
      if (w->ops.av.remove) w->ops.av.remove = av_remove;
      (*av)->ops = &w->ops.av;
    }
  }
  return rc;
}
static int dom_cq_open(struct fid_domain* d, struct fi_cq_attr* attr, struct fid_cq** cq, void* ctx) {
  int rc = orig_domain(d)->cq_open(d, attr, cq, ctx);
  if (rc == 0) wrap_fid(&(*cq)->fid, kCq);
  return rc;
}
static int dom_endpoint(struct fid_domain* d, struct fi_info* info, struct fid_ep** ep, void* ctx) {
  int rc = orig_domain(d)->endpoint(d, info, ep, ctx);
  if (rc == 0) wrap_fid(&(*ep)->fid, kEndpoint);
  return rc;
}

static const struct fi_ops_mr* orig_mr(struct fid* domain_fid) { return wrap_of(domain_fid)->orig_mr; }
static void mr_made(struct fid_mr* mr, const struct iovec* iov, size_t count) {
  struct Wrap* w = wrap_fid(&mr->fid, kMr);
  long bytes = 0;
  for (size_t i = 0; i < count; i++) bytes += (long)iov[i].iov_len;
  if (w) w->bytes = bytes;
  count_new(kMrBytes, bytes);
}
static int mr_reg(struct fid* fid, const void* buf, size_t len, uint64_t access, uint64_t offset,
                  uint64_t key, uint64_t flags, struct fid_mr** mr, void* ctx) {
  int rc = orig_mr(fid)->reg(fid, buf, len, access, offset, key, flags, mr, ctx);
  struct iovec iov = {(void*)buf, len};
  if (rc == 0) mr_made(*mr, &iov, 1);
  return rc;
}
static int mr_regv(struct fid* fid, const struct iovec* iov, size_t count, uint64_t access,
                   uint64_t offset, uint64_t key, uint64_t flags, struct fid_mr** mr, void* ctx) {
  int rc = orig_mr(fid)->regv(fid, iov, count, access, offset, key, flags, mr, ctx);
  if (rc == 0) mr_made(*mr, iov, count);
  return rc;
}
static int mr_regattr(struct fid* fid, const struct fi_mr_attr* attr, uint64_t flags, struct fid_mr** mr) {
  int rc = orig_mr(fid)->regattr(fid, attr, flags, mr);
  if (rc == 0) mr_made(*mr, attr->mr_iov, attr->iov_count);
  return rc;
}

static int fab_domain(struct fid_fabric* f, struct fi_info* info, struct fid_domain** dom, void* ctx) {
  const struct fi_ops_fabric* orig = wrap_of(&f->fid)->orig_ops;
  int rc = orig->domain(f, info, dom, ctx);
  if (rc != 0) return rc;
  struct fid_domain* d = *dom;
  struct Wrap* w = wrap_fid(&d->fid, kDomain);
  if (!w) return rc;
  COPY_TABLE(w->ops.domain, d->ops);
  w->orig_ops = d->ops;
  if (w->ops.domain.av_open) w->ops.domain.av_open = dom_av_open;
  if (w->ops.domain.cq_open) w->ops.domain.cq_open = dom_cq_open;
  if (w->ops.domain.endpoint) w->ops.domain.endpoint = dom_endpoint;
  d->ops = &w->ops.domain;
  if (d->mr) {
    COPY_TABLE(w->mr, d->mr);
    w->orig_mr = d->mr;
    if (w->mr.reg) w->mr.reg = mr_reg;
    if (w->mr.regv) w->mr.regv = mr_regv;
    if (w->mr.regattr) w->mr.regattr = mr_regattr;
    d->mr = &w->mr;
  }
  return rc;
}

/* ---- the exports ponte's loader binds --------------------------------------------------------------- */

__attribute__((visibility("default"))) int fi_getinfo(uint32_t version, const char* node,
                                                      const char* service, uint64_t flags,
                                                      const struct fi_info* hints, struct fi_info** info) {
  if (!ready()) return -FI_ENOSYS;
  return real.getinfo(version, node, service, flags, hints, info);
}
__attribute__((visibility("default"))) void fi_freeinfo(struct fi_info* info) {
  if (ready()) real.freeinfo(info);
}
__attribute__((visibility("default"))) struct fi_info* fi_dupinfo(const struct fi_info* info) {
  return ready() ? real.dupinfo(info) : NULL;
}
__attribute__((visibility("default"))) const char* fi_strerror(int errnum) {
  return ready() ? real.strerror(errnum) : "libponte-ficount: no real libfabric";
}
__attribute__((visibility("default"))) uint32_t fi_version(void) {
  return ready() ? real.version() : FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
}
__attribute__((visibility("default"))) int fi_fabric(struct fi_fabric_attr* attr,
                                                     struct fid_fabric** fabric, void* context) {
  if (!ready()) return -FI_ENOSYS;
  int rc = real.fabric(attr, fabric, context);
  if (rc != 0) return rc;
  struct fid_fabric* f = *fabric;
  struct Wrap* w = wrap_fid(&f->fid, kFabric);
  if (!w) return rc;
  COPY_TABLE(w->ops.fabric, f->ops);
  w->orig_ops = f->ops;
  if (w->ops.fabric.domain) w->ops.fabric.domain = fab_domain;
  f->ops = &w->ops.fabric;
  return rc;
}
