/*
 * A stand-in for NCCL that loads the trainscope profiler plugin and calls it as
 * NCCL 2.30's user and proxy threads do (src/plugin/profiler.cc,
 * src/enqueue.cc hostStreamPlanTask, src/transport/net.cc send/recvProxyProgress,
 * src/transport/profiler.cc): no GPU, no NCCL library. Used by
 * tests/integration/test_nccl_plugin.py; what it checks is the plugin's logic,
 * not NCCL's real timing.
 *
 * usage: nccl_driver PLUGIN.so VERSION(4|5|6) SCENARIO
 *   main     rank 1 of a 4-rank communicator: a ring all-reduce (2 channels, 12
 *            transfers per proxy op) that completes, sends on one thread and
 *            receives on another; then a second one whose channel 1 has chunks
 *            GPU-ready that are never transmitted (no credit from the receiver),
 *            held 350 ms, then finalize.
 *   exhaust  four collectives started on a pool of two (TRAINSCOPE_NCCL_POOL_COLLS=2):
 *            two dropped and counted; children of dropped parents; finalize.
 *   nodir    the main calls with whatever init gave back (no ring: a no-op).
 * Prints "pid N", "mask M", "done".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "trainscope_nccl_profiler.h"

#define NRANKS 4
#define RANK 1
#define NEXT 2                         /* ring successor: sends go there */
#define PREV 0                         /* ring predecessor: receives come from there */
#define NCHAN 2
#define NSTEPS 12                      /* 2(n-1) algorithm steps x 2 transfers (Simple: chunk 4 / slice 2) */
#define TRANS 262144                   /* bytes per transfer */
#define COMM_HASH 0x5eed0000c0ffee01ull

static int version;
static const ncclProfiler_v4_t* p4;
static const ncclProfiler_v5_t* p5;    /* v6 has v5's functions; descriptors differ (built below) */
static const ncclProfiler_v6_t* p6;
static void* ctx;

static void pause_us(long us) {
  struct timespec t = {0, us * 1000};
  nanosleep(&t, NULL);
}

static void log_fn(ts_log_level level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)level; (void)flags; (void)file; (void)line; (void)fmt;
}

typedef struct {
  uint64_t type;
  void* parent;
  ts_coll_descr_v5 coll;
  ts_proxy_op_descr op;
  int step;
  uint8_t channel;
} ev_t;

/* v5 and v6 descriptors share these fields' names (their layouts differ: each version is filled in its own type) */
#define FILL_DESCR_V5_PLUS(d, e) do {                                                                   \
    memset(&(d), 0, sizeof(d));                                                                         \
    (d).type = (e)->type; (d).parentObj = (e)->parent; (d).rank = RANK;                                 \
    if ((e)->type == ncclProfileColl) (d).coll = (e)->coll;                                             \
    if ((e)->type == ncclProfileProxyOp) (d).proxyOp = (e)->op;                                         \
    if ((e)->type == ncclProfileProxyStep) (d).proxyStep.step = (e)->step;                              \
    if ((e)->type == ncclProfileKernelCh) { (d).kernelCh.channelId = (e)->channel; (d).kernelCh.pTimer = 12345; } \
    if ((e)->type == ncclProfileCollApi) { (d).collApi.func = "AllReduce"; (d).collApi.count = 1; }     \
  } while (0)

static void* start(const ev_t* e) {
  void* h = (void*)0x1;                /* the plugin must always set it */
  if (version == 4) {
    ncclProfilerEventDescr_v4_t d;
    memset(&d, 0, sizeof d);
    d.type = (uint8_t)e->type; d.parentObj = e->parent; d.rank = RANK;
    if (e->type == ncclProfileColl) memcpy(&d.coll, &e->coll, sizeof d.coll);
    if (e->type == ncclProfileProxyOp) d.proxyOp = e->op;
    if (e->type == ncclProfileProxyStep) d.proxyStep.step = e->step;
    if (e->type == ncclProfileKernelCh) { d.kernelCh.channelId = e->channel; d.kernelCh.pTimer = 12345; }
    p4->startEvent(ctx, &h, &d);
  } else if (version == 5) {
    ncclProfilerEventDescr_v5_t d;
    FILL_DESCR_V5_PLUS(d, e);
    p5->startEvent(ctx, &h, &d);
  } else {
    ncclProfilerEventDescr_v6_t d;
    FILL_DESCR_V5_PLUS(d, e);
    p6->startEvent(ctx, &h, &d);
  }
  return h;
}

static void stop(void* h) {
  if (!h) return;                      /* NCCL never stops a NULL handle */
  if (version == 4) p4->stopEvent(h); else if (version == 5) p5->stopEvent(h); else p6->stopEvent(h);
}

static void record(void* h, int state, size_t trans, uint64_t ptimer) {
  if (!h) return;
  ncclProfilerEventStateArgs_v4_t a;
  memset(&a, 0, sizeof a);
  if (state == ncclProfilerKernelChStop) a.kernelCh.pTimer = ptimer; else a.proxyStep.transSize = trans;
  if (version == 4) p4->recordEventState(h, state, &a);
  else if (version == 5) p5->recordEventState(h, state, &a);
  else p6->recordEventState(h, state, &a);
}

static void* start_coll(void* api_parent, uint64_t seq) {
  ev_t e;
  memset(&e, 0, sizeof e);
  e.type = ncclProfileColl;
  e.parent = api_parent;
  e.coll.seqNumber = seq;
  e.coll.func = "AllReduce";
  e.coll.count = 1 << 20;
  e.coll.datatype = "ncclFloat32";
  e.coll.nChannels = NCHAN;
  e.coll.nWarps = 16;
  e.coll.algo = "RING";
  e.coll.proto = "SIMPLE";
  return start(&e);
}

static void* start_op(void* coll, int ch, int peer, int is_send) {
  ev_t e;
  memset(&e, 0, sizeof e);
  e.type = ncclProfileProxyOp;
  e.parent = coll;
  e.op.pid = getpid();
  e.op.channelId = (uint8_t)ch;
  e.op.peer = peer;
  e.op.nSteps = NSTEPS;
  e.op.chunkSize = 2 * TRANS;
  e.op.isSend = is_send;
  return start(&e);
}

static void* start_step(void* op, int step) {
  ev_t e;
  memset(&e, 0, sizeof e);
  e.type = ncclProfileProxyStep;
  e.parent = op;
  e.step = step;
  return start(&e);
}

static void* start_kernel(void* coll, int ch) {
  ev_t e;
  memset(&e, 0, sizeof e);
  e.type = ncclProfileKernelCh;
  e.parent = coll;
  e.channel = (uint8_t)ch;
  return start(&e);
}

/* ------------------------------------------------------ one collective */
typedef struct {
  void* coll;
  void* send[NCHAN];
  void* recv[NCHAN];
  void* kernel[NCHAN];
  int stall;                           /* channel 1's sends: GPU-ready, never transmitted */
  pthread_barrier_t appended;          /* NCCL appends every op of a plan before progressing any */
} coll_run;

/* the proxy thread's send side (net.cc sendProxyProgress): post -> GPU ready -> isend -> done */
static void* send_thread(void* arg) {
  coll_run* r = arg;
  for (int ch = 0; ch < NCHAN; ch++) r->send[ch] = start_op(r->coll, ch, NEXT, 1);
  for (int ch = 0; ch < NCHAN; ch++) record(r->send[ch], ncclProfilerProxyOpInProgress_v4, 0, 0);
  pthread_barrier_wait(&r->appended);
  for (int i = 0; i < NSTEPS; i++) {
    for (int ch = 0; ch < NCHAN; ch++) {
      int stuck = r->stall && ch == 1;
      if (stuck && i >= 4) continue;   /* NCCL posts at most 8 ahead; here the sender stops at 4 */
      void* s = start_step(r->send[ch], i);
      record(s, ncclProfilerProxyStepSendGPUWait, 0, 0);
      pause_us(100);
      record(s, ncclProfilerProxyStepSendPeerWait_v4, 0, 0);          /* the GPU filled the buffer */
      if (stuck) { record(s, ncclProfilerProxyStepSendPeerWait_v4, 0, 0); continue; }   /* no credit: retried */
      record(s, ncclProfilerProxyStepSendWait, TRANS, 0);             /* isend posted */
      pause_us(100);
      stop(s);                                                        /* send completed */
    }
  }
  for (int ch = 0; ch < NCHAN; ch++)
    if (!(r->stall && ch == 1)) stop(r->send[ch]);
  return NULL;
}

/* the proxy thread's receive side (net.cc recvProxyProgress) and the kernel events
 * (transport/profiler.cc: KernelCh start when the kernel begins a channel, stop when it ends) */
static void* recv_thread(void* arg) {
  coll_run* r = arg;
  for (int ch = 0; ch < NCHAN; ch++) r->recv[ch] = start_op(r->coll, ch, PREV, 0);
  for (int ch = 0; ch < NCHAN; ch++) r->kernel[ch] = start_kernel(r->coll, ch);
  pthread_barrier_wait(&r->appended);
  for (int i = 0; i < NSTEPS; i++) {
    for (int ch = 0; ch < NCHAN; ch++) {
      if (r->stall && ch == 1 && i >= 4) continue;
      void* s = start_step(r->recv[ch], i);
      record(s, ncclProfilerProxyStepRecvWait, 0, 0);
      if (r->stall && ch == 1) continue;                              /* nothing arrives on channel 1 */
      pause_us(150);
      record(s, ncclProfilerProxyStepRecvGPUWait, TRANS, 0);
      pause_us(50);
      stop(s);
    }
  }
  for (int ch = 0; ch < NCHAN; ch++) {
    if (r->stall && ch == 1) continue;
    stop(r->recv[ch]);
    record(r->kernel[ch], ncclProfilerKernelChStop, 0, 67890);
    stop(r->kernel[ch]);
  }
  return NULL;
}

static void run_collective(uint64_t seq, int stall) {
  coll_run r;
  memset(&r, 0, sizeof r);
  r.stall = stall;
  pthread_barrier_init(&r.appended, NULL, 3);
  /* hostStreamPlanTask: group event, task (Coll) events, proxy ops uploaded, Coll stop, group stop */
  ev_t g;
  memset(&g, 0, sizeof g);
  g.type = ncclProfileGroup;
  void* group = start(&g);             /* not asked for: the plugin must hand back NULL */
  void* api = NULL;
  if (version >= 5) { ev_t a; memset(&a, 0, sizeof a); a.type = ncclProfileCollApi; api = start(&a); }
  r.coll = start_coll(api, seq);
  pthread_t ts, tr;
  pthread_create(&ts, NULL, send_thread, &r);
  pthread_create(&tr, NULL, recv_thread, &r);
  pthread_barrier_wait(&r.appended);
  stop(r.coll);                        /* enqueued: not done */
  stop(group);
  stop(api);
  pthread_join(ts, NULL);
  pthread_join(tr, NULL);
  pthread_barrier_destroy(&r.appended);
  if (group != NULL) { printf("error: group handle not NULL\n"); exit(3); }
}

static uint64_t real_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Hold the stall until the plugin's state thread has reported channel 1 of collective `seq`
 * `rounds` times at or after `after` (read from the ring, as the collector would), or 20 s: the test does not
 * depend on how fast a loaded host schedules that thread. No ring (a no-op plugin): 350 ms. */
static int wait_for_states(uint64_t seq, int rounds, uint64_t after) {
  const char* dir = getenv("TRAINSCOPE_NCCL_DIR");
  char path[4096];
  struct stat st;
  int fd = -1;
  if (dir) {
    snprintf(path, sizeof path, "%s/ring-%d", dir, (int)getpid());
    fd = open(path, O_RDONLY);
  }
  if (fd < 0 || fstat(fd, &st) != 0) { if (fd >= 0) close(fd); pause_us(350000); return 0; }
  const char* m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return 0;
  const ts_ring_header* h = (const ts_ring_header*)m;
  const ts_slot* slots = (const ts_slot*)(m + sizeof(ts_ring_header));
  int seen = 0;
  uint64_t next = 0;
  for (int tries = 0; tries < 2000 && seen < rounds; tries++) {
    uint64_t head = __atomic_load_n(&h->head, __ATOMIC_ACQUIRE);
    for (; next < head; next++) {
      const ts_slot* sl = &slots[next & (h->capacity - 1)];
      while (__atomic_load_n(&sl->seq, __ATOMIC_ACQUIRE) != next + 1) pause_us(100);
      if (sl->kind == TS_STATE && sl->coll_seq == seq && sl->channel == 1 && sl->a >= after) seen++;
    }
    if (seen < rounds) pause_us(10000);
  }
  munmap((void*)m, (size_t)st.st_size);
  return seen;
}

/* NCCL's cost of calling a plugin that does nothing: the baseline of "bench" */
static ncclResult_t empty_start(void* c, void** h, ncclProfilerEventDescr_v4_t* d) { (void)c; (void)d; *h = NULL; return ncclSuccess; }
static ncclResult_t empty_stop(void* h) { (void)h; return ncclSuccess; }
static ncclResult_t empty_record(void* h, ncclProfilerEventState_t s, ncclProfilerEventStateArgs_v4_t* a) {
  (void)h; (void)s; (void)a; return ncclSuccess;
}

static double step_cycles(int n, int plugin, void* op) {
  ncclResult_t (*volatile v_start)(void*, void**, ncclProfilerEventDescr_v4_t*) = plugin ? p4->startEvent : empty_start;
  ncclResult_t (*volatile v_stop)(void*) = plugin ? p4->stopEvent : empty_stop;
  ncclResult_t (*volatile v_record)(void*, ncclProfilerEventState_t, ncclProfilerEventStateArgs_v4_t*) =
      plugin ? p4->recordEventState : empty_record;
  ncclProfilerEventDescr_v4_t d;
  memset(&d, 0, sizeof d);
  d.type = ncclProfileProxyStep; d.parentObj = op; d.rank = RANK;
  ncclProfilerEventStateArgs_v4_t a;
  memset(&a, 0, sizeof a);
  a.proxyStep.transSize = TRANS;
  struct timespec t0, t1;              /* thread CPU time: other work on the host is not counted */
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
  for (int i = 0; i < n; i++) {
    void* h = NULL;
    d.proxyStep.step = i;
    v_start(ctx, &h, &d);
    v_record(h, ncclProfilerProxyStepSendGPUWait, &a);
    v_record(h, ncclProfilerProxyStepSendPeerWait_v4, &a);
    v_record(h, ncclProfilerProxyStepSendWait, &a);
    v_stop(h);
  }
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n;
}

/* thread-CPU ns per send step (start, 3 state changes, stop: what NCCL's proxy thread calls per network
 * transfer), plugin against empty functions, best of 5 rounds each, one thread */
static void bench(void) {
  if (version != 4) { printf("bench: version 4 only\n"); return; }
  void* coll = start_coll(NULL, 0);
  void* op = start_op(coll, 0, NEXT, 1);
  double best_plugin = 1e18, best_empty = 1e18;
  for (int r = 0; r < 5; r++) {
    double e = step_cycles(200000, 0, op), p = step_cycles(200000, 1, op);
    if (e < best_empty) best_empty = e;
    if (p < best_plugin) best_plugin = p;
  }
  printf("bench plugin_ns_per_step %.1f empty_ns_per_step %.1f\n", best_plugin, best_empty);
  stop(op);
  stop(coll);
}

int main(int argc, char** argv) {
  if (argc != 4) { fprintf(stderr, "usage: nccl_driver PLUGIN.so 4|5|6 main|exhaust|nodir\n"); return 2; }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
  version = atoi(argv[2]);
  p4 = dlsym(lib, "ncclProfiler_v4");
  p5 = dlsym(lib, "ncclProfiler_v5");
  p6 = dlsym(lib, "ncclProfiler_v6");
  if (!p4 || !p5 || !p6) { fprintf(stderr, "missing ncclProfiler_v4/v5/v6\n"); return 2; }
  printf("pid %d\n", (int)getpid());
  int mask = -1;
  ncclResult_t rc;
  if (version == 4) rc = p4->init(&ctx, &mask, "trainscope-test", COMM_HASH, NRANKS, NRANKS, RANK, log_fn);
  else if (version == 5) rc = p5->init(&ctx, COMM_HASH, &mask, "trainscope-test", NRANKS, NRANKS, RANK, log_fn);
  else rc = p6->init(&ctx, COMM_HASH, &mask, "trainscope-test", NRANKS, NRANKS, RANK, log_fn);
  printf("mask %d\n", mask);
  if (rc != ncclSuccess) { printf("error: init returned %d\n", rc); return 3; }
  const char* scen = argv[3];
  if (!strcmp(scen, "main") || !strcmp(scen, "nodir")) {
    run_collective(0, 0);
    run_collective(1, 1);              /* returns when both proxy threads are done: counters final */
    uint64_t settled = real_ns();
    printf("settled %llu\n", (unsigned long long)settled);
    printf("states %d\n", wait_for_states(1, 3, settled));   /* the stall, until the plugin reported it */
  } else if (!strcmp(scen, "bench")) {
    bench();
  } else if (!strcmp(scen, "reinit")) {
    /* the last communicator finalized (NCCL may dlclose the plugin), then a new one: the ring of
     * this pid is made again (a new file), not appended to */
    if (version == 4) p4->finalize(ctx); else if (version == 5) p5->finalize(ctx); else p6->finalize(ctx);
    mask = -1;
    if (version == 4) p4->init(&ctx, &mask, "again", COMM_HASH + 1, 1, 2, 0, log_fn);
    else p5->init(&ctx, COMM_HASH + 1, &mask, "again", 1, 2, 0, log_fn);
    printf("mask2 %d\n", mask);
  } else if (!strcmp(scen, "exhaust")) {
    void* c[4];
    for (int i = 0; i < 4; i++) c[i] = start_coll(NULL, (uint64_t)i);
    int dropped = (c[2] == NULL) + (c[3] == NULL);
    void* op = start_op(c[3], 0, NEXT, 1);          /* parent dropped: NULL, no crash */
    void* st = start_step(op, 0);
    record(st, ncclProfilerProxyStepSendWait, TRANS, 0);
    stop(st);
    stop(op);
    printf("null handles %d\n", dropped);
    for (int i = 0; i < 4; i++) stop(c[i]);
  } else {
    fprintf(stderr, "unknown scenario %s\n", scen);
    return 2;
  }
  if (version == 4) p4->finalize(ctx); else if (version == 5) p5->finalize(ctx); else p6->finalize(ctx);
  printf("done\n");
  fflush(stdout);
  return 0;
}
