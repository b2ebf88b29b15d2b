/*
 * trainscope NCCL profiler plugin: the ABI it implements and the ring it writes.
 *
 * Part 1 declares the NCCL profiler plugin interface, versions 4, 5 and 6, as
 * NCCL 2.30.7 defines it (NVIDIA/nccl, src/include/plugin/nccl_profiler.h and
 * src/include/plugin/profiler/profiler_v4.h, profiler_v5.h, profiler_v6.h;
 * checked against the copies in plugins/profiler/example/nccl/). The
 * declarations are written here from those headers' layouts, field for field
 * in the same order and types: the struct layout is the contract, the names
 * of our own choosing are marked "ts_". Only the events and states trainscope
 * uses are listed; the other union members exist so that the descriptor sizes
 * match.
 *
 * Part 2 is trainscope's own ring layout (read by collector/nccl_profiler.py:
 * HEADER and SLOT there, the table in docs/collectives.md).
 */
#ifndef TRAINSCOPE_NCCL_PROFILER_H_
#define TRAINSCOPE_NCCL_PROFILER_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* ------------------------------------------------------------ part 1: NCCL */

typedef enum {                       /* err.h: a plugin only ever returns ncclSuccess */
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6
} ncclResult_t;

typedef enum { TS_LOG_NONE = 0, TS_LOG_VERSION = 1, TS_LOG_WARN = 2, TS_LOG_INFO = 3 } ts_log_level;
#define TS_LOG_SUBSYS_INIT 1UL       /* NCCL_INIT */
typedef void (*ncclDebugLogger_t)(ts_log_level level, unsigned long flags, const char* file, int line,
                                  const char* fmt, ...);

/* event type bits (nccl_profiler.h) */
enum {
  ncclProfileGroup = 1 << 0,
  ncclProfileColl = 1 << 1,
  ncclProfileP2p = 1 << 2,
  ncclProfileProxyOp = 1 << 3,
  ncclProfileProxyStep = 1 << 4,
  ncclProfileProxyCtrl = 1 << 5,
  ncclProfileKernelCh = 1 << 6,
  ncclProfileNetPlugin = 1 << 7,
  ncclProfileGroupApi = 1 << 8,
  ncclProfileCollApi = 1 << 9,
  ncclProfileP2pApi = 1 << 10,
  ncclProfileKernelLaunch = 1 << 11,
};

/* the states trainscope reads (ncclProfilerEventState_t; values are NCCL's) */
typedef int ncclProfilerEventState_t;
enum {
  ncclProfilerProxyOpInProgress_v4 = 19,
  ncclProfilerProxyStepSendGPUWait = 8,
  ncclProfilerProxyStepSendPeerWait_v4 = 20,
  ncclProfilerProxyStepSendWait = 9,
  ncclProfilerProxyStepRecvWait = 10,
  ncclProfilerProxyStepRecvFlushWait = 11,
  ncclProfilerProxyStepRecvGPUWait = 12,
  ncclProfilerKernelChStop = 22,
};

/* descriptor members shared by v4-v6 (same layout in the three unions) */
typedef struct {
  pid_t pid;              /* process that made the proxy op (PXN: maybe not us) */
  uint8_t channelId;
  int peer;               /* comm rank sent to / received from */
  int nSteps;             /* network transfers of this op */
  int chunkSize;
  int isSend;
} ts_proxy_op_descr;

typedef struct { int step; } ts_proxy_step_descr;
typedef struct { uint8_t channelId; uint64_t pTimer; } ts_kernel_ch_descr;
typedef struct { int64_t id; void* data; } ts_net_plugin_descr;

typedef struct {
  uint64_t seqNumber;
  const char* func;
  void const* sendBuff;
  void* recvBuff;
  size_t count;
  int root;
  const char* datatype;
  uint8_t nChannels;
  uint8_t nWarps;
  const char* algo;
  const char* proto;
} ts_coll_descr_v4;

typedef struct {
  const char* func; void* buff; const char* datatype; size_t count; int peer; uint8_t nChannels;
} ts_p2p_descr_v4;

typedef struct {                     /* ncclProfilerEventDescr_v4_t */
  uint8_t type;
  void* parentObj;
  int rank;
  union {
    ts_coll_descr_v4 coll;
    ts_p2p_descr_v4 p2p;
    ts_proxy_op_descr proxyOp;
    ts_proxy_step_descr proxyStep;
    ts_kernel_ch_descr kernelCh;
    ts_net_plugin_descr netPlugin;
  };
} ncclProfilerEventDescr_v4_t;

typedef union {                      /* ncclProfilerEventStateArgs_v4_t (= v5 = v6) */
  struct { size_t transSize; } proxyStep;
  struct { int appendedProxyOps; } proxyCtrl;
  struct { void* data; } netPlugin;
  struct { uint64_t pTimer; } kernelCh;
} ncclProfilerEventStateArgs_v4_t;
typedef ncclProfilerEventStateArgs_v4_t ncclProfilerEventStateArgs_v5_t;
typedef ncclProfilerEventStateArgs_v4_t ncclProfilerEventStateArgs_v6_t;

typedef struct {
  uint64_t seqNumber;
  const char* func;
  void const* sendBuff;
  void* recvBuff;
  size_t count;
  int root;
  const char* datatype;
  uint8_t nChannels;
  uint8_t nWarps;
  const char* algo;
  const char* proto;
  void* parentGroup;                 /* v5: the v4-style group parent */
} ts_coll_descr_v5;

typedef struct {
  const char* func; void* buff; const char* datatype; size_t count; int peer; uint8_t nChannels; void* parentGroup;
} ts_p2p_descr_v5;

#define TS_V5_API_MEMBERS                                                                             \
  struct { bool graphCaptured; int groupDepth; } groupApi;                                           \
  struct { const char* func; size_t count; const char* datatype; int root; void* stream;             \
           bool graphCaptured; } collApi;                                                            \
  struct { const char* func; size_t count; const char* datatype; void* stream; bool graphCaptured; } \
      p2pApi;                                                                                        \
  struct { void* stream; } kernelLaunch;

typedef struct {                     /* ncclProfilerEventDescr_v5_t: type widened to 64 bits */
  uint64_t type;
  void* parentObj;
  int rank;
  union {
    TS_V5_API_MEMBERS
    ts_coll_descr_v5 coll;
    ts_p2p_descr_v5 p2p;
    ts_proxy_op_descr proxyOp;
    ts_proxy_step_descr proxyStep;
    ts_kernel_ch_descr kernelCh;
    ts_net_plugin_descr netPlugin;
  };
} ncclProfilerEventDescr_v5_t;

typedef struct {                     /* ncclProfilerEventDescr_v6_t: v5 plus the copy-engine events */
  uint64_t type;
  void* parentObj;
  int rank;
  union {
    TS_V5_API_MEMBERS
    ts_coll_descr_v5 coll;
    ts_p2p_descr_v5 p2p;
    ts_proxy_op_descr proxyOp;
    ts_proxy_step_descr proxyStep;
    ts_kernel_ch_descr kernelCh;
    ts_net_plugin_descr netPlugin;
    struct {
      uint64_t seqNumber; const char* func; void const* sendBuff; void* recvBuff; size_t count; int root;
      const char* datatype; const char* syncStrategy; bool intraBatchSync; uint32_t batchSize;
      uint32_t numBatches; uint32_t ceSeqNum; void* stream;
    } ceColl;
    struct { bool isComplete; int nRanks; } ceCollSync;
    struct { int numOps; size_t totalBytes; bool useIntraSync; } ceCollBatch;
  };
} ncclProfilerEventDescr_v6_t;

typedef struct {                     /* ncclProfiler_v4_t */
  const char* name;
  ncclResult_t (*init)(void** context, int* eActivationMask, const char* commName, uint64_t commHash,
                       int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, ncclProfilerEventDescr_v4_t* eDescr);
  ncclResult_t (*stopEvent)(void* eHandle);
  ncclResult_t (*recordEventState)(void* eHandle, ncclProfilerEventState_t eState,
                                   ncclProfilerEventStateArgs_v4_t* eStateArgs);
  ncclResult_t (*finalize)(void* context);
} ncclProfiler_v4_t;

typedef struct {                     /* ncclProfiler_v5_t: init takes the comm id second */
  const char* name;
  ncclResult_t (*init)(void** context, uint64_t commId, int* eActivationMask, const char* commName,
                       int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, ncclProfilerEventDescr_v5_t* eDescr);
  ncclResult_t (*stopEvent)(void* eHandle);
  ncclResult_t (*recordEventState)(void* eHandle, ncclProfilerEventState_t eState,
                                   ncclProfilerEventStateArgs_v5_t* eStateArgs);
  ncclResult_t (*finalize)(void* context);
} ncclProfiler_v5_t;

typedef struct {                     /* ncclProfiler_v6_t: v5's functions, v6 descriptors */
  const char* name;
  ncclResult_t (*init)(void** context, uint64_t commId, int* eActivationMask, const char* commName,
                       int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, ncclProfilerEventDescr_v6_t* eDescr);
  ncclResult_t (*stopEvent)(void* eHandle);
  ncclResult_t (*recordEventState)(void* eHandle, ncclProfilerEventState_t eState,
                                   ncclProfilerEventStateArgs_v6_t* eStateArgs);
  ncclResult_t (*finalize)(void* context);
} ncclProfiler_v6_t;

/* ------------------------------------------------------ part 2: the ring */

#define TS_RING_MAGIC "TSNCCLR1"
#define TS_RING_VERSION 1u

typedef struct {                     /* 64 bytes; HEADER in collector/nccl_profiler.py */
  char magic[8];
  uint32_t version;
  uint32_t slot_bytes;
  uint64_t capacity;                 /* a power of two */
  uint64_t head;                     /* slots claimed so far (atomic fetch-add) */
  uint64_t dropped;                  /* events dropped: a handle pool was empty */
  uint64_t detached;                 /* events whose parent was not ours (PXN, dropped parent) */
  uint64_t truncated;                /* flows beyond a collective's flow table, not written */
  uint64_t stale;                    /* collectives retired without a completion */
} ts_ring_header;

typedef struct {                     /* 64 bytes; SLOT in collector/nccl_profiler.py */
  uint64_t seq;                      /* claim index + 1, stored last (release) */
  uint8_t kind, channel, algo, proto, func, dtype;
  uint16_t flags;
  uint64_t comm, coll_seq, a, b, c;
  uint32_t d, e;
} ts_slot;

enum { TS_COMM = 1, TS_COLL = 2, TS_FLOW = 3, TS_RECV = 4, TS_STATE = 5 };
#define TS_COLL_FLOWS_TRUNCATED 1u   /* COLL flags: some flows were not written */

#endif
