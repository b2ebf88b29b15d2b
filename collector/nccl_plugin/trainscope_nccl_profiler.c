/*
 * trainscope NCCL profiler plugin (libnccl-profiler-trainscope.so): Mycroft's
 * per-channel chunk states and Vedrfolnir's per-step flows from NCCL's proxy
 * events, written to a shared-memory ring that the collector reads.
 *
 * Design: docs/collectives.md, "NCCL profiler plugin". Reader:
 * collector/nccl_profiler.py. ABI: trainscope_nccl_profiler.h (NCCL 2.30.7's
 * profiler v4, v5, v6). Build: `trainscope nccl-plugin build`. Verified with
 * a C driver that calls it as NCCL's user and proxy threads do
 * (tests/integration/nccl_driver.c); NOT yet run under real NCCL on a GPU.
 *
 * Steps (Mycroft §4.2 "chunk-level" state records; Vedrfolnir §III step records):
 *
 * 1. init (per communicator): the first one opens the ring
 *    <dir>/ring-<pid> (dir: $TRAINSCOPE_NCCL_DIR, else the per-user runtime
 *    directory's nccl/ as proto/env.py's runtime_dir() names it), 0600,
 *    O_CREAT|O_EXCL|O_NOFOLLOW, maps it and starts the state thread (step 6);
 *    every one writes a COMM slot and asks for Coll|ProxyOp|ProxyStep|KernelCh.
 *    Any failure (no runtime directory, a directory that is not ours, open or
 *    mmap failing) leaves the plugin a no-op: activation mask 0, ncclSuccess.
 * 2. Coll start: a handle from a preallocated pool (bounded probes of a
 *    rotating cursor; an empty pool drops the event and counts it in the
 *    ring header), the collective's number on its communicator (every
 *    collective, any function: the n-th collective of a communicator is the
 *    same on every member), and its counters zeroed. Reference count 1.
 * 3. ProxyOp / KernelCh start: a child handle (pool), the parent's reference
 *    count +1 (the parent is dereferenced only when the op was made in this
 *    process: PXN ops from another process are counted "detached"). A send op
 *    adds its nSteps to its channel's total_chunks and names its peer.
 * 4. ProxyStep (one network transfer): its handle is the op's step slot
 *    step % 8 (NCCL keeps at most NCCL_STEPS = 8 in flight per op and indexes
 *    its own handles the same way: no allocation per step). Send side,
 *    counted once per step: left SendGPUWait (SendPeerWait or SendWait) ->
 *    GPU_ready; entered SendWait -> RDMA_transmitted (transSize kept); stop ->
 *    RDMA_done and the step's flow (algorithm step, destination): bytes,
 *    first ready, last stop (lock-free: CAS on the key, fetch-add, CAS min/max).
 *    Receive side: the time in RecvWait.
 * 5. Completion: when the Coll was stopped (enqueued), no child is live, at
 *    least one child stopped and, when kernel events came, one per channel
 *    stopped, the thread that dropped the last reference writes the FLOW
 *    slots, one RECV slot and the COLL slot, then frees the handle. All work
 *    per call is O(1) (the completion writes one slot per flow).
 * 6. State thread (one per process, every 100 ms): for each collective in
 *    flight for at least 100 ms, one STATE slot per channel with send ops:
 *    GPU_ready, RDMA_transmitted, RDMA_done, total_chunks, the peer. A thread
 *    and not a check on event calls: a stalled collective is exactly the one
 *    for which NCCL stops calling the plugin. It takes no lock NCCL holds and
 *    only reads the counters. It also retires collectives that kept no
 *    reference for 10 s without completing (counted "stale").
 * 7. Ring writes: claim index i with an atomic fetch-add on head, mark the
 *    slot invalid (seq 0), fill it, store seq = i + 1 with release ordering.
 *    Writers never wait on the reader; a slow reader loses the oldest slots.
 */
#define _GNU_SOURCE
#include "trainscope_nccl_profiler.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TS_EXPORT __attribute__((visibility("default")))
#define TS_MAX_CHANNELS 64            /* NCCL's MAXCHANNELS */
#define TS_STEP_SLOTS 8               /* NCCL_STEPS */
#define TS_MAX_FLOWS 256              /* (algorithm step, destination) pairs kept per collective */
#define TS_FLOW_PROBES 16
#define TS_POOL_PROBES 8
#define TS_MAX_COMMS 256
#define TS_STATE_PERIOD_NS 100000000ull
#define TS_STALE_NS 10000000000ull
#define TS_ACTIVATION (ncclProfileColl | ncclProfileProxyOp | ncclProfileProxyStep | ncclProfileKernelCh)

enum { K_COLL = 0x71, K_OP = 0x72, K_STEP = 0x73, K_KERNEL = 0x74 };   /* first byte of each handle */
enum { FREE = 0, CLAIMED = 1, LIVE = 2 };
enum { ST_READY = 1, ST_TX = 2, ST_RECV_WAIT = 4, ST_RECV_DONE = 8, ST_USED = 16 };

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define RLOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_ACQ_REL)
#define FADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)

typedef struct {
  int used;
  uint64_t comm;
  int rank, nranks, nnodes;
  uint64_t ncoll;                     /* collectives started on this communicator */
} ts_ctx;

typedef struct {
  uint32_t total, ready, tx, done;    /* Mycroft's counters for this channel (send side) */
  int32_t peer;                       /* comm rank this channel sends to, -1 unknown */
} ts_chan;

typedef struct {
  uint64_t key;                       /* ((step << 32) | peer) + 1; 0 = empty */
  uint64_t bytes, first, last;        /* absolute CLOCK_REALTIME ns */
} ts_flow;

typedef struct {
  uint8_t kind;                       /* K_COLL */
  uint32_t state;
  uint64_t comm, seq;
  int nranks;
  uint8_t func, algo, proto, dtype, nchan;
  int steps_per_loop, xfer_per_step;
  uint64_t bytes;
  uint64_t t_enqueue, t_first_kernel, t_first_step, t_idle;
  int32_t refs, stopped_children, kernel_starts, kernel_stops, enqueued;
  uint32_t nflows;
  uint64_t chans;                     /* bit c: channel c has a send op */
  uint64_t recv_wait_ns, recv_steps, truncated;
  ts_chan ch[TS_MAX_CHANNELS];
  ts_flow flows[TS_MAX_FLOWS];
} ts_coll;

struct ts_op;
typedef struct {
  uint8_t kind;                       /* K_STEP */
  uint8_t flags;
  int step;
  struct ts_op* op;
  uint64_t t_ready, t_recv_wait, size;
} ts_step;

typedef struct ts_op {
  uint8_t kind;                       /* K_OP or K_KERNEL */
  uint32_t state;
  ts_coll* coll;
  int is_send, peer, chan, nsteps;
  ts_step steps[TS_STEP_SLOTS];
} ts_op;

/* ---------------------------------------------------------------- globals */
static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;   /* init/finalize only */
static int g_ok;                      /* the ring is mapped: events are recorded */
static int g_live_ctx;
static pid_t g_pid;
static ts_ring_header* g_hdr;
static ts_slot* g_slots;
static uint64_t g_mask;               /* capacity - 1 */
static size_t g_map_bytes;
static ts_ctx g_ctx[TS_MAX_COMMS];
static ts_coll* g_colls;
static ts_op* g_ops;
static uint32_t g_ncolls, g_nops;
static uint64_t g_coll_cursor, g_op_cursor;
static pthread_t g_thread;
static int g_thread_on;
static pthread_mutex_t g_thread_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_thread_cond;
static int g_thread_stop;
static ncclDebugLogger_t g_log;

#define INFO(...) do { if (g_log) g_log(TS_LOG_INFO, TS_LOG_SUBSYS_INIT, __func__, __LINE__, __VA_ARGS__); } while (0)

static uint64_t now_ns(void) {        /* the collector's clock (time.time_ns) */
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void count(uint64_t* counter) {
  if (g_hdr) FADD(counter, 1);
}

/* ------------------------------------------------------------ step 7: ring */
static void ring_put(const ts_slot* s) {
  uint64_t i = FADD(&g_hdr->head, 1);
  ts_slot* dst = &g_slots[i & g_mask];
  __atomic_store_n(&dst->seq, 0, __ATOMIC_RELAXED);        /* a reader copying it now sees it torn */
  __atomic_thread_fence(__ATOMIC_RELEASE);
  memcpy((char*)dst + 8, (const char*)s + 8, sizeof(ts_slot) - 8);
  __atomic_store_n(&dst->seq, i + 1, __ATOMIC_RELEASE);
}

/* ------------------------------------------------------------- name codes */
static uint8_t code_of(const char* s, const char* const* names, int n) {
  if (!s) return 0;
  for (int i = 0; i < n; i++)
    if (names[i] && strcmp(s, names[i]) == 0) return (uint8_t)i;
  return 0;
}

static const char* const FUNC_NAMES[] = {0, "Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce",
                                         "Send", "Recv", "AlltoAll"};
static const char* const ALGO_NAMES[] = {0, "TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS",
                                         "NVLS_TREE", "PAT"};
static const char* const PROTO_NAMES[] = {0, "LL", "LL128", "SIMPLE"};
static const char* const DTYPE_NAMES[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64",
                                          "ncclUint64", "ncclFloat16", "ncclFloat32", "ncclFloat64",
                                          "ncclBfloat16", "ncclFloat8e4m3", "ncclFloat8e5m2"};
static const uint8_t DTYPE_BYTES[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};

static uint8_t dtype_code(const char* s) {
  if (!s) return 255;
  for (int i = 0; i < (int)(sizeof(DTYPE_NAMES) / sizeof(*DTYPE_NAMES)); i++)
    if (strcmp(s, DTYPE_NAMES[i]) == 0) return (uint8_t)i;
  return 255;
}

/* --------------------------------------------------------------- pools */
static void* pool_claim(void* base, size_t size, uint32_t n, uint64_t* cursor) {
  for (int k = 0; k < TS_POOL_PROBES && n; k++) {
    uint64_t i = FADD(cursor, 1) % n;
    uint32_t* state = (uint32_t*)((char*)base + i * size + offsetof(ts_op, state));
    uint32_t expect = FREE;
    if (__atomic_compare_exchange_n(state, &expect, CLAIMED, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
      return (char*)base + i * size;
  }
  count(&g_hdr->dropped);
  return NULL;
}
_Static_assert(offsetof(ts_op, state) == offsetof(ts_coll, state), "pool state offset");

static void atomic_min64(uint64_t* p, uint64_t v) {
  uint64_t cur = RLOAD(p);
  while ((cur == 0 || v < cur) && !__atomic_compare_exchange_n(p, &cur, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

static void atomic_max64(uint64_t* p, uint64_t v) {
  uint64_t cur = RLOAD(p);
  while (v > cur && !__atomic_compare_exchange_n(p, &cur, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

/* ------------------------------------------------- step 6: the state thread */
static void write_states(uint64_t t_real, uint64_t t_mono) {
  for (uint32_t i = 0; i < g_ncolls; i++) {
    ts_coll* c = &g_colls[i];
    if (LOAD(&c->state) != LIVE) continue;
    if (t_real < c->t_enqueue + TS_STATE_PERIOD_NS) continue;
    uint64_t chans = RLOAD(&c->chans);
    for (int ch = 0; chans && ch < TS_MAX_CHANNELS; ch++) {
      if (!(chans & (1ull << ch))) continue;
      ts_chan* k = &c->ch[ch];
      int32_t peer = RLOAD(&k->peer);
      ts_slot s = {0};
      s.kind = TS_STATE;
      s.channel = (uint8_t)ch;
      s.algo = c->algo; s.proto = c->proto; s.func = c->func; s.dtype = c->dtype;
      s.flags = (uint16_t)(peer >= 0 && peer < 65535 ? peer + 1 : 0);
      s.comm = c->comm; s.coll_seq = c->seq;
      s.a = t_real;
      s.b = RLOAD(&k->done);
      s.c = RLOAD(&k->total);
      s.d = RLOAD(&k->ready);
      s.e = RLOAD(&k->tx);
      if (LOAD(&c->state) != LIVE) break;                   /* completed meanwhile: nothing to say */
      ring_put(&s);
    }
    /* a collective holding no reference, never completed: retire it after TS_STALE_NS */
    if (RLOAD(&c->refs) == 0 && RLOAD(&c->enqueued)) {
      uint64_t idle = RLOAD(&c->t_idle);
      if (idle == 0) {
        uint64_t z = 0;
        __atomic_compare_exchange_n(&c->t_idle, &z, t_mono, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
      } else if (t_mono - idle > TS_STALE_NS) {
        uint32_t expect = LIVE;
        if (__atomic_compare_exchange_n(&c->state, &expect, FREE, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
          count(&g_hdr->stale);
      }
    } else if (RLOAD(&c->t_idle)) {
      __atomic_store_n(&c->t_idle, 0, __ATOMIC_RELAXED);
    }
  }
}

static void* state_thread(void* arg) {
  (void)arg;
  pthread_mutex_lock(&g_thread_lock);
  while (!g_thread_stop) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_nsec += (long)TS_STATE_PERIOD_NS;
    if (until.tv_nsec >= 1000000000L) { until.tv_sec += 1; until.tv_nsec -= 1000000000L; }
    while (!g_thread_stop && pthread_cond_timedwait(&g_thread_cond, &g_thread_lock, &until) != ETIMEDOUT) {
    }
    if (g_thread_stop) break;
    pthread_mutex_unlock(&g_thread_lock);
    if (LOAD(&g_ok) && getpid() == g_pid) write_states(now_ns(), mono_ns());
    pthread_mutex_lock(&g_thread_lock);
  }
  pthread_mutex_unlock(&g_thread_lock);
  return NULL;
}

static void start_thread(void) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&g_thread_cond, &a);
  pthread_condattr_destroy(&a);
  g_thread_stop = 0;
  sigset_t all, old;                  /* the thread takes no signal meant for the training process */
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  g_thread_on = pthread_create(&g_thread, NULL, state_thread, NULL) == 0;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static void stop_thread(void) {
  if (!g_thread_on) return;
  pthread_mutex_lock(&g_thread_lock);
  g_thread_stop = 1;
  pthread_cond_signal(&g_thread_cond);
  pthread_mutex_unlock(&g_thread_lock);
  pthread_join(g_thread, NULL);
  pthread_cond_destroy(&g_thread_cond);
  g_thread_on = 0;
}

/* ------------------------------------------------------ step 1: the ring */
static int private_dir_ok(const char* path) {
  struct stat st;
  if (lstat(path, &st) != 0) return 0;
  return S_ISDIR(st.st_mode) && (st.st_uid == geteuid() || st.st_uid == 0) && !(st.st_mode & 022);
}

static int ring_dir(char* out, size_t n) {
  const char* dir = getenv("TRAINSCOPE_NCCL_DIR");
  char rt[3072];
  if (dir && *dir) {
    if (snprintf(out, n, "%s", dir) >= (int)n) return 0;
  } else {
    const char* xdg = getenv("XDG_RUNTIME_DIR");
    if (xdg && xdg[0] == '/') {
      if (snprintf(rt, sizeof rt, "%s/trainscope", xdg) >= (int)sizeof rt) return 0;
    } else {                          /* Python's tempfile.gettempdir(): TMPDIR, TEMP, TMP, /tmp */
      const char* tmp = getenv("TMPDIR");
      if (!tmp || !*tmp) tmp = getenv("TEMP");
      if (!tmp || !*tmp) tmp = getenv("TMP");
      if (!tmp || !*tmp) tmp = "/tmp";
      if (snprintf(rt, sizeof rt, "%s/trainscope-%u", tmp, (unsigned)geteuid()) >= (int)sizeof rt) return 0;
    }
    if (!private_dir_ok(rt)) return 0;   /* no runtime directory (no collector here): stay a no-op */
    if (snprintf(out, n, "%s/nccl", rt) >= (int)n) return 0;
  }
  if (mkdir(out, 0700) != 0 && errno != EEXIST) return 0;
  return private_dir_ok(out);
}

static uint64_t env_pow2(const char* name, uint64_t dflt, uint64_t lo, uint64_t hi) {
  const char* s = getenv(name);
  if (!s || !*s) return dflt;
  char* end;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end || v < lo || v > hi) return dflt;
  uint64_t p = lo;
  while (p < v) p <<= 1;
  return p;
}

static int open_ring(void) {
  char dir[4096], path[4160];
  if (!ring_dir(dir, sizeof dir)) return 0;
  snprintf(path, sizeof path, "%s/ring-%d", dir, (int)getpid());
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EEXIST) {
    /* our own pid's ring: left by an earlier load of this plugin in this process, or by a dead
     * process that had our pid. Replace it only when it is a plain file of ours. */
    struct stat st;
    if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) return 0;
    if (unlink(path) != 0) return 0;
    fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  }
  if (fd < 0) return 0;
  uint64_t cap = env_pow2("TRAINSCOPE_NCCL_RING_SLOTS", 1u << 16, 256, 1u << 22);
  size_t bytes = sizeof(ts_ring_header) + cap * sizeof(ts_slot);
  if (ftruncate(fd, (off_t)bytes) != 0) { close(fd); unlink(path); return 0; }
  void* m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) { unlink(path); return 0; }
  g_hdr = (ts_ring_header*)m;
  g_slots = (ts_slot*)((char*)m + sizeof(ts_ring_header));
  g_mask = cap - 1;
  g_map_bytes = bytes;
  g_hdr->version = TS_RING_VERSION;
  g_hdr->slot_bytes = sizeof(ts_slot);
  g_hdr->capacity = cap;
  __atomic_thread_fence(__ATOMIC_RELEASE);
  memcpy(g_hdr->magic, TS_RING_MAGIC, 8);                   /* the magic last: a reader sees a whole header */
  INFO("trainscope profiler: ring %s, %llu slots", path, (unsigned long long)cap);
  return 1;
}

static void child_after_fork(void) {
  g_ok = 0;                           /* a forked child must not write into its parent's ring */
  g_thread_on = 0;
}

static int g_tried;                   /* setup_once ran (reset by teardown: NCCL may load us again) */

static int setup_once(void) {
  static int atfork;
  if (g_tried) return g_ok;
  g_tried = 1;
  g_pid = getpid();
  if (!atfork) { pthread_atfork(NULL, NULL, child_after_fork); atfork = 1; }
  g_ncolls = (uint32_t)env_pow2("TRAINSCOPE_NCCL_POOL_COLLS", 256, 1, 4096);
  g_nops = (uint32_t)env_pow2("TRAINSCOPE_NCCL_POOL_OPS", 2048, 1, 65536);
  if (!open_ring()) return 0;
  g_colls = calloc(g_ncolls, sizeof(ts_coll));
  g_ops = calloc(g_nops, sizeof(ts_op));
  if (!g_colls || !g_ops) {
    free(g_colls); free(g_ops); g_colls = NULL; g_ops = NULL;
    munmap(g_hdr, g_map_bytes); g_hdr = NULL;
    return 0;
  }
  STORE(&g_ok, 1);
  start_thread();
  return 1;
}

static void teardown(void) {          /* the last communicator is gone: NCCL may dlclose us next */
  stop_thread();
  STORE(&g_ok, 0);
  free(g_colls); free(g_ops); g_colls = NULL; g_ops = NULL;
  if (g_hdr) munmap(g_hdr, g_map_bytes);
  g_hdr = NULL; g_slots = NULL;
  g_tried = 0;
}

static ncclResult_t ts_init(void** context, int* mask, const char* name, uint64_t comm, int nnodes, int nranks,
                            int rank, ncclDebugLogger_t logfn) {
  (void)name;
  *context = NULL;
  if (logfn) g_log = logfn;
  pthread_mutex_lock(&g_init_lock);
  int ok = setup_once() && getpid() == g_pid;
  ts_ctx* ctx = NULL;
  for (int i = 0; ok && i < TS_MAX_COMMS; i++)
    if (!g_ctx[i].used) { ctx = &g_ctx[i]; break; }
  if (ctx) {
    memset(ctx, 0, sizeof *ctx);
    ctx->used = 1; ctx->comm = comm; ctx->rank = rank; ctx->nranks = nranks; ctx->nnodes = nnodes;
    g_live_ctx++;
  } else if (ok) {
    count(&g_hdr->dropped);
  }
  pthread_mutex_unlock(&g_init_lock);
  if (!ctx) {
    if (!ok) INFO("trainscope profiler: no ring (no runtime directory, or it is not this user's): off");
    __atomic_store_n(mask, 0, __ATOMIC_RELAXED);             /* NCCL's mask is global: 0 keeps it quiet */
    return ncclSuccess;
  }
  ts_slot s = {0};
  s.kind = TS_COMM; s.comm = comm; s.a = now_ns(); s.c = (uint64_t)nnodes; s.d = (uint32_t)rank; s.e = (uint32_t)nranks;
  ring_put(&s);
  __atomic_store_n(mask, TS_ACTIVATION, __ATOMIC_RELAXED);
  *context = ctx;
  return ncclSuccess;
}

static ncclResult_t ts_finalize(void* context) {
  ts_ctx* ctx = (ts_ctx*)context;
  if (!ctx) return ncclSuccess;
  pthread_mutex_lock(&g_init_lock);
  if (ctx->used) {
    for (uint32_t i = 0; g_ops && i < g_nops; i++)           /* its ops and collectives in flight are forgotten */
      if (LOAD(&g_ops[i].state) == LIVE && g_ops[i].coll && g_ops[i].coll->comm == ctx->comm)
        STORE(&g_ops[i].state, FREE);
    for (uint32_t i = 0; g_colls && i < g_ncolls; i++)
      if (g_colls[i].comm == ctx->comm && LOAD(&g_colls[i].state) != FREE) STORE(&g_colls[i].state, FREE);
    ctx->used = 0;
    if (--g_live_ctx == 0) teardown();
  }
  pthread_mutex_unlock(&g_init_lock);
  return ncclSuccess;
}

/* ------------------------------------------------- steps 2-5: the events */
typedef struct {                      /* the descriptor fields used, whatever the version */
  uint64_t type;
  void* parent;
  uint64_t seq;
  const char *func, *dtype, *algo, *proto;
  size_t count;
  uint8_t nchan;
  ts_proxy_op_descr op;
  int step;
} ts_ev;

static int steps_per_loop(uint8_t func, uint8_t algo, int nranks) {
  if (algo != 2 || nranks < 2) return 1;                      /* tree, pipelines, NVLS, ...: 1 per loop */
  if (func == 5) return 2 * (nranks - 1);                     /* ncclPatternRingTwice */
  if (func == 3 || func == 4) return nranks - 1;              /* ncclPatternRing */
  return 1;
}

static void* start_coll(ts_ctx* ctx, const ts_ev* e) {
  ts_coll* c = pool_claim(g_colls, sizeof(ts_coll), g_ncolls, &g_coll_cursor);
  if (!c) return NULL;
  c->kind = K_COLL;
  c->comm = ctx->comm;
  c->nranks = ctx->nranks;
  c->seq = FADD(&ctx->ncoll, 1);
  c->func = code_of(e->func, FUNC_NAMES, 9);
  c->algo = code_of(e->algo, ALGO_NAMES, 8);
  c->proto = code_of(e->proto, PROTO_NAMES, 4);
  c->dtype = dtype_code(e->dtype);
  c->nchan = e->nchan;
  c->bytes = (uint64_t)e->count * (c->dtype < sizeof DTYPE_BYTES ? DTYPE_BYTES[c->dtype] : 1);
  c->steps_per_loop = steps_per_loop(c->func, c->algo, ctx->nranks);
  /* ring + Simple: a chunk is ALLREDUCE_CHUNKSTEPS / ALLREDUCE_SLICESTEPS = 2 network transfers */
  c->xfer_per_step = (c->algo == 2 && c->proto == 3) ? 2 : 1;
  c->t_enqueue = now_ns();
  c->t_first_kernel = c->t_first_step = c->t_idle = 0;
  c->refs = 1;
  c->stopped_children = c->kernel_starts = c->kernel_stops = c->enqueued = 0;
  c->recv_wait_ns = c->recv_steps = c->truncated = 0;
  uint64_t used = c->chans;
  for (int ch = 0; used && ch < TS_MAX_CHANNELS; ch++)
    if (used & (1ull << ch)) memset(&c->ch[ch], 0, sizeof c->ch[ch]);
  for (int ch = 0; ch < TS_MAX_CHANNELS; ch++) c->ch[ch].peer = -1;
  c->chans = 0;
  if (c->nflows) memset(c->flows, 0, sizeof c->flows);
  c->nflows = 0;
  STORE(&c->state, LIVE);
  return c;
}

static ts_coll* live_coll(void* p) {
  ts_coll* c = (ts_coll*)p;
  if (!c || c->kind != K_COLL || LOAD(&c->state) != LIVE) return NULL;
  return c;
}

static void complete(ts_coll* c);

static void unref(ts_coll* c) {
  if (ADD(&c->refs, -1) != 0) return;
  if (!LOAD(&c->enqueued) || LOAD(&c->stopped_children) == 0) return;     /* children still to come */
  int ks = LOAD(&c->kernel_starts);
  if (ks > 0 && LOAD(&c->kernel_stops) < (int)c->nchan) return;           /* a channel's kernel still to come */
  complete(c);
}

static void* start_child(ts_ctx* ctx, const ts_ev* e, int kernel) {
  (void)ctx;
  if (!kernel && e->op.pid != g_pid) { count(&g_hdr->detached); return NULL; }   /* PXN: parent not ours */
  ts_coll* c = live_coll(e->parent);
  if (!c) { count(&g_hdr->detached); return NULL; }
  ts_op* op = pool_claim(g_ops, sizeof(ts_op), g_nops, &g_op_cursor);
  if (!op) return NULL;
  ADD(&c->refs, 1);
  op->kind = kernel ? K_KERNEL : K_OP;
  op->coll = c;
  uint64_t t = now_ns();
  if (kernel) {
    ADD(&c->kernel_starts, 1);
    atomic_min64(&c->t_first_kernel, t);
  } else {
    op->is_send = e->op.isSend;
    op->peer = e->op.peer;
    op->chan = e->op.channelId % TS_MAX_CHANNELS;
    op->nsteps = e->op.nSteps;
    for (int i = 0; i < TS_STEP_SLOTS; i++) op->steps[i].flags = 0;
    if (op->is_send) {
      ts_chan* k = &c->ch[op->chan];
      FADD(&k->total, (uint32_t)(e->op.nSteps > 0 ? e->op.nSteps : 0));
      int32_t none = -1;
      __atomic_compare_exchange_n(&k->peer, &none, op->peer, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
      __atomic_fetch_or(&c->chans, 1ull << op->chan, __ATOMIC_RELEASE);
    }
  }
  STORE(&op->state, LIVE);
  return op;
}

static void* start_step(const ts_ev* e) {
  ts_op* op = (ts_op*)e->parent;
  if (!op || op->kind != K_OP || LOAD(&op->state) != LIVE) { count(&g_hdr->detached); return NULL; }
  ts_step* s = &op->steps[(unsigned)e->step % TS_STEP_SLOTS];
  s->kind = K_STEP;
  s->flags = ST_USED;
  s->step = e->step;
  s->op = op;
  s->t_ready = s->t_recv_wait = s->size = 0;
  if (!RLOAD(&op->coll->t_first_step)) atomic_min64(&op->coll->t_first_step, now_ns());   /* the clock once */
  return s;
}

static void* start_event(void* context, const ts_ev* e) {
  ts_ctx* ctx = (ts_ctx*)context;
  if (!ctx || !LOAD(&g_ok) || getpid() != g_pid) return NULL;
  switch (e->type) {
    case ncclProfileColl: return start_coll(ctx, e);
    case ncclProfileProxyOp: return start_child(ctx, e, 0);
    case ncclProfileKernelCh: return start_child(ctx, e, 1);
    case ncclProfileProxyStep: return start_step(e);
    default: return NULL;             /* Group, CollApi, P2p, ...: not asked for, or not used */
  }
}

/* the clock is read only where a time is kept: ~100 ns a read on a virtualised host */
static void mark_ready(ts_step* s, uint64_t t) {
  if (s->flags & ST_READY) return;
  s->flags |= ST_READY;
  s->t_ready = t ? t : now_ns();
  FADD(&s->op->coll->ch[s->op->chan].ready, 1);
}

static void mark_tx(ts_step* s) {
  if (s->flags & ST_TX) return;
  s->flags |= ST_TX;
  FADD(&s->op->coll->ch[s->op->chan].tx, 1);
}

static void close_recv_wait(ts_step* s, uint64_t t) {
  if ((s->flags & ST_RECV_WAIT) && !(s->flags & ST_RECV_DONE)) {
    s->flags |= ST_RECV_DONE;
    FADD(&s->op->coll->recv_wait_ns, t - s->t_recv_wait);
  }
}

static ncclResult_t record_state(void* h, ncclProfilerEventState_t st, const ncclProfilerEventStateArgs_v4_t* a) {
  ts_step* s = (ts_step*)h;
  if (!s || s->kind != K_STEP || !(s->flags & ST_USED) || !LOAD(&g_ok)) return ncclSuccess;
  switch (st) {
    case ncclProfilerProxyStepSendPeerWait_v4: mark_ready(s, 0); break;
    case ncclProfilerProxyStepSendWait:
      mark_ready(s, 0);
      mark_tx(s);
      if (a) s->size = a->proxyStep.transSize;
      break;
    case ncclProfilerProxyStepRecvWait:
      if (!(s->flags & ST_RECV_WAIT)) { s->flags |= ST_RECV_WAIT; s->t_recv_wait = now_ns(); }
      break;
    case ncclProfilerProxyStepRecvFlushWait:
    case ncclProfilerProxyStepRecvGPUWait:
      if ((s->flags & ST_RECV_WAIT) && !(s->flags & ST_RECV_DONE)) close_recv_wait(s, now_ns());
      if (a && a->proxyStep.transSize) s->size = a->proxyStep.transSize;
      break;
    default: break;                   /* SendGPUWait (posted, not ready yet), KernelChStop, op states */
  }
  return ncclSuccess;
}

static void add_flow(ts_coll* c, uint64_t step, int peer, uint64_t bytes, uint64_t first, uint64_t last) {
  uint64_t key = ((step << 32) | (uint32_t)peer) + 1;
  uint64_t h = (key * 0x9E3779B97F4A7C15ull) >> 56;          /* 8 bits: TS_MAX_FLOWS = 256 */
  for (int k = 0; k < TS_FLOW_PROBES; k++) {
    ts_flow* f = &c->flows[(h + k) % TS_MAX_FLOWS];
    uint64_t cur = LOAD(&f->key);
    if (cur == 0) {
      uint64_t z = 0;
      if (__atomic_compare_exchange_n(&f->key, &z, key, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        FADD(&c->nflows, 1);
        cur = key;
      } else {
        cur = z;
      }
    }
    if (cur != key) continue;
    FADD(&f->bytes, bytes);
    atomic_min64(&f->first, first ? first : last);
    atomic_max64(&f->last, last);
    return;
  }
  FADD(&c->truncated, 1);
  count(&g_hdr->truncated);
}

static void stop_step(ts_step* s) {
  ts_op* op = s->op;
  ts_coll* c = op->coll;
  uint64_t t = now_ns();
  if (op->is_send) {
    mark_ready(s, t);
    mark_tx(s);
    FADD(&c->ch[op->chan].done, 1);
    uint64_t algo_step = ((uint64_t)s->step / (uint64_t)c->xfer_per_step) % (uint64_t)c->steps_per_loop;
    add_flow(c, algo_step, op->peer, s->size, s->t_ready, t);
  } else {
    close_recv_wait(s, t);
    FADD(&c->recv_steps, 1);
  }
  s->flags = 0;
}

static ncclResult_t stop_event(void* h) {
  if (!h || !LOAD(&g_ok)) return ncclSuccess;
  uint8_t kind = *(uint8_t*)h;
  if (kind == K_COLL) {
    ts_coll* c = live_coll(h);
    if (!c) return ncclSuccess;
    STORE(&c->enqueued, 1);           /* a Coll's stop means enqueued, not done */
    unref(c);
  } else if (kind == K_OP || kind == K_KERNEL) {
    ts_op* op = (ts_op*)h;
    if (LOAD(&op->state) != LIVE) return ncclSuccess;
    ts_coll* c = op->coll;
    if (kind == K_KERNEL) ADD(&c->kernel_stops, 1);
    ADD(&c->stopped_children, 1);
    STORE(&op->state, FREE);
    unref(c);
  } else if (kind == K_STEP) {
    ts_step* s = (ts_step*)h;
    if ((s->flags & ST_USED) && LOAD(&s->op->state) == LIVE) stop_step(s);
  }
  return ncclSuccess;
}

/* step 5: FLOW slots, RECV, then COLL (the reader joins them by (comm, coll_seq)) */
static void complete(ts_coll* c) {
  uint64_t end = now_ns();
  uint32_t written = 0;
  for (int i = 0; i < TS_MAX_FLOWS; i++) {
    ts_flow* f = &c->flows[i];
    if (!f->key) continue;
    ts_slot s = {0};
    s.kind = TS_FLOW; s.algo = c->algo; s.proto = c->proto; s.func = c->func; s.dtype = c->dtype;
    s.comm = c->comm; s.coll_seq = c->seq;
    s.a = f->first > c->t_enqueue ? f->first - c->t_enqueue : 0;
    s.b = f->last > c->t_enqueue ? f->last - c->t_enqueue : 0;
    s.c = f->bytes;
    s.d = (uint32_t)((f->key - 1) >> 32);
    s.e = (uint32_t)((f->key - 1) & 0xffffffffu);
    ring_put(&s);
    written++;
  }
  if (c->recv_steps) {
    ts_slot s = {0};
    s.kind = TS_RECV; s.func = c->func; s.comm = c->comm; s.coll_seq = c->seq;
    s.a = c->recv_wait_ns; s.c = c->recv_steps;
    ring_put(&s);
  }
  uint64_t start = c->t_first_kernel ? c->t_first_kernel : (c->t_first_step ? c->t_first_step : c->t_enqueue);
  ts_slot s = {0};
  s.kind = TS_COLL; s.algo = c->algo; s.proto = c->proto; s.func = c->func; s.dtype = c->dtype;
  s.flags = c->truncated ? TS_COLL_FLOWS_TRUNCATED : 0;
  s.channel = c->nchan;
  s.comm = c->comm; s.coll_seq = c->seq;
  s.a = c->t_enqueue; s.b = end; s.c = c->bytes;
  s.d = (uint32_t)(start > c->t_enqueue ? (start - c->t_enqueue) / 1000 : 0);
  s.e = written;
  ring_put(&s);
  STORE(&c->state, FREE);
}

/* ------------------------------------------------------ version wrappers */
static ncclResult_t init_v4(void** ctx, int* mask, const char* name, uint64_t comm, int nnodes, int nranks, int rank,
                            ncclDebugLogger_t logfn) {
  return ts_init(ctx, mask, name, comm, nnodes, nranks, rank, logfn);
}

static ncclResult_t init_v5(void** ctx, uint64_t comm, int* mask, const char* name, int nnodes, int nranks, int rank,
                            ncclDebugLogger_t logfn) {
  return ts_init(ctx, mask, name, comm, nnodes, nranks, rank, logfn);
}

#define FILL_EVENT(ev, d)                                                                    \
  do {                                                                                       \
    memset(&(ev), 0, sizeof(ev));                                                            \
    (ev).type = (d)->type;                                                                   \
    (ev).parent = (d)->parentObj;                                                            \
    if ((ev).type == ncclProfileColl) {                                                      \
      (ev).seq = (d)->coll.seqNumber; (ev).func = (d)->coll.func;                            \
      (ev).dtype = (d)->coll.datatype; (ev).algo = (d)->coll.algo;                           \
      (ev).proto = (d)->coll.proto; (ev).count = (d)->coll.count;                            \
      (ev).nchan = (d)->coll.nChannels;                                                      \
    } else if ((ev).type == ncclProfileProxyOp) {                                            \
      (ev).op = (d)->proxyOp;                                                                \
    } else if ((ev).type == ncclProfileProxyStep) {                                          \
      (ev).step = (d)->proxyStep.step;                                                       \
    }                                                                                        \
  } while (0)

static ncclResult_t start_v4(void* ctx, void** h, ncclProfilerEventDescr_v4_t* d) {
  *h = NULL;
  if (!d) return ncclSuccess;
  ts_ev ev;
  FILL_EVENT(ev, d);
  *h = start_event(ctx, &ev);
  return ncclSuccess;
}

static ncclResult_t start_v5(void* ctx, void** h, ncclProfilerEventDescr_v5_t* d) {
  *h = NULL;
  if (!d) return ncclSuccess;
  ts_ev ev;
  FILL_EVENT(ev, d);
  *h = start_event(ctx, &ev);
  return ncclSuccess;
}

static ncclResult_t start_v6(void* ctx, void** h, ncclProfilerEventDescr_v6_t* d) {
  *h = NULL;
  if (!d) return ncclSuccess;
  ts_ev ev;
  FILL_EVENT(ev, d);
  *h = start_event(ctx, &ev);
  return ncclSuccess;
}

static ncclResult_t record_v4(void* h, ncclProfilerEventState_t st, ncclProfilerEventStateArgs_v4_t* a) {
  return record_state(h, st, a);
}

TS_EXPORT const ncclProfiler_v4_t ncclProfiler_v4 = {"trainscope", init_v4, start_v4, stop_event, record_v4,
                                                     ts_finalize};
TS_EXPORT const ncclProfiler_v5_t ncclProfiler_v5 = {"trainscope", init_v5, start_v5, stop_event, record_v4,
                                                     ts_finalize};
TS_EXPORT const ncclProfiler_v6_t ncclProfiler_v6 = {"trainscope", init_v5, start_v6, stop_event, record_v4,
                                                     ts_finalize};
