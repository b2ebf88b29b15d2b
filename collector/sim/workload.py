"""The per-iteration kernel and phase schedule of a hybrid-parallel training job.

A :class:`Template` is the static half of the simulation: the numbered kernel
*slots* one iteration runs (the same on every rank of a stage), what each slot
is (name, stream, kind, median duration, the group of a collective, the
semantic phase it belongs to), and per pipeline stage the *program* that the
engine executes: ops ``F(m)``/``B(m)`` per micro-batch made of compute blocks
and collectives, in 1F1B order.

1. Layer shape follows Megatron-LM: LayerNorm → QKV GEMM → (CP all-gather) →
   flash attention → projection GEMM → TP all-reduce → residual add →
   LayerNorm → MLP (dense: fc1/GELU/fc2) or MoE (router, top-k, permute, EP
   all-to-all, grouped expert GEMMs, all-to-all back, unpermute) → TP
   all-reduce → add. Backward mirrors it with dgrad + wgrad GEMMs.
2. The same kernel name recurs at several positions with different medians
   (QKV/projection/fc1/fc2 GEMMs share a cuBLAS kernel; gradient buckets of
   different sizes share one ReduceScatter kernel), and the same collective
   kernel runs on several streams (EP all-to-all and PP send/recv are both
   ``ncclDevKernel_SendRecv``): the multimodal structure of ARGUS §5.2,
   Figure 5.
3. Each collective runs on its own stream per process group; compute, H2D and
   D2H copies run on the compute stream (7).
4. Stage-dependent work: stage 0 embeds tokens and does not receive forward
   activations; the last stage computes the LM head and the loss and does not
   receive gradients. ``present[stage, slot]`` says which slots a stage runs.
5. Gradient sync: one ReduceScatter bucket per layer on the dp stream, launched
   as soon as the layer's gradients of the last micro-batch are ready
   (overlap-grad-reduce), then grad-norm (all-reduce over the model-parallel
   group, which with the dp sync aligns every rank: ARGUS §9.3
   ``finish_grad_sync``), Adam, and the parameter all-gather.
6. Medians are relative (µs at nominal size); the engine scales them so that a
   healthy iteration lasts ``iteration_s``.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from trainscope.collector.sim.topology import MP, Topology
from trainscope.proto.columnar import KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET
from trainscope.proto.v1.telemetry_pb2 import PHASE_CLOCK_CPU, PHASE_CLOCK_CUDA_EVENT

# ------------------------------------------------------------------ names
GEMM_FWD = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas"
GEMM_DGRAD = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64_cublas"
GEMM_WGRAD = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize128x128x64_cublas"
FLASH_FWD = "flash_fwd_kernel"
FLASH_BWD = "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel"
LN_FWD = "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>"
LN_BWD = "void at::native::(anonymous namespace)::layer_norm_grad_input_kernel<c10::BFloat16, float>"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16> >"
GELU = "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>"
GELU_BWD = "void at::native::vectorized_elementwise_kernel<4, at::native::GeluBackwardCUDAKernelImpl>"
EMBED = "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int>"
EMBED_BWD = "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<c10::BFloat16, float, long>"
CE_FWD = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>"
CE_BWD = "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float>"
TOPK = "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>"
PERMUTE = "void transformer_engine::moe_permute_row_map<int>"
UNPERMUTE = "void transformer_engine::moe_unpermute_kernel<__nv_bfloat16, float, true>"
EXPERT_FWD = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_grouped_bf16_128x128_32x4_tn_align8>"
EXPERT_DGRAD = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_grouped_bf16_128x128_32x4_nn_align8>"
EXPERT_WGRAD = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_grouped_bf16_128x128_32x4_nt_align8>"
ADAM = "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float> >"
L2NORM = "void multi_tensor_apply_kernel<TensorListMetadata<1>, L2NormFunctor<float> >"
H2D = "Memcpy HtoD (Pageable -> Device)"
D2H = "Memcpy DtoH (Device -> Pageable)"
MEMSET = "Memset (Device)"
AR_BF16 = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
AR_F32 = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
RS_F32 = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"
RS_BF16 = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"
AG = "ncclDevKernel_AllGather_RING_LL"
SENDRECV = "ncclDevKernel_SendRecv"

#: CUDA stream of each role.
STREAM = {"compute": 7, "tp": 20, "cp": 24, "ep": 28, "dp": 32, MP: 36, "pp_next": 40, "pp_prev": 44}

# ------------------------------------------------------------------ slot categories
CAT_COMPUTE, CAT_MEMCPY, CAT_MEMSET, CAT_COLL, CAT_P2P = range(5)
# aggregate-phase tags of slots
TAG_NONE, TAG_ATTN, TAG_MLP, TAG_EXPERT, TAG_A2A, TAG_RECV, TAG_SEND = range(-1, 6)
OP_PRE, OP_F, OP_B, OP_BUCKET, OP_POST = range(5)
# where a slot runs
ALL, NOT_FIRST, NOT_LAST, FIRST, LAST = range(5)


@dataclasses.dataclass(frozen=True, slots=True)
class PhaseDef:
    """One phase record per rank per iteration (``micro_batch`` for forward/backward)."""

    name: str
    micro_batch: int = 0
    clock: int = PHASE_CLOCK_CUDA_EVENT
    stream: int = STREAM["compute"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Template:
    """Kernel slots and per-stage programs of one iteration (see the module docstring)."""

    names: tuple[str, ...]
    name_id: np.ndarray
    stream: np.ndarray
    kind: np.ndarray
    cat: np.ndarray
    base_us: np.ndarray
    dim: tuple[str | None, ...]
    tag: np.ndarray
    op: np.ndarray
    mb: np.ndarray
    layer: np.ndarray
    present: np.ndarray          # (pp, K) bool
    programs: tuple              # per stage: tuple of (op, mb, steps)
    pre: tuple                   # steps run on every rank before the pipeline
    buckets: tuple[int, ...]     # dp ReduceScatter slots, in launch order (last layer first)
    bucket_layer: tuple[int, ...]
    post: tuple                  # steps run on every rank after the pipeline
    phases: tuple[PhaseDef, ...]
    moe: bool
    micro_batches: int
    layers: int

    @property
    def K(self) -> int:
        return len(self.name_id)

    def kernel_keys(self, mask: np.ndarray) -> list[dict]:
        """Distinct (name, stream) of the masked slots, for ground truth."""
        keys = sorted({(self.names[n], int(s)) for n, s in
                       zip(self.name_id[mask].tolist(), self.stream[mask].tolist())})
        return [{"name": n, "stream": s} for n, s in keys]

    def kernels_per_iteration(self) -> list[int]:
        return self.present.sum(axis=1).tolist()


class _Builder:
    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.names: dict[str, int] = {}

    def slot(self, name, stream, cat, base_us, *, kind=KIND_KERNEL, dim=None, tag=TAG_NONE,
             op=OP_PRE, mb=-1, layer=-1, where=ALL) -> int:
        nid = self.names.setdefault(name, len(self.names))
        self.rows.append((nid, stream, kind, cat, base_us, dim, tag, op, mb, layer, where))
        return len(self.rows) - 1


def build_template(topo: Topology, *, layers: int, micro_batches: int, moe: bool | None = None) -> Template:
    """Build the template of ``topo`` (step numbers refer to the module docstring)."""
    moe = topo.ep > 1 if moe is None else moe
    b = _Builder()
    C = STREAM["compute"]
    M, L = micro_batches, layers

    def comp(steps, name, base, *, tag=TAG_NONE, kind=KIND_KERNEL, cat=CAT_COMPUTE, where=ALL, **kw):
        s = b.slot(name, C, cat, base, kind=kind, tag=tag, where=where, **kw)
        if steps and steps[-1][0] == "comp":
            steps[-1][1].append(s)
        else:
            steps.append(("comp", [s]))
        return s

    def coll(steps, name, dim, base, *, tag=TAG_NONE, **kw):
        if topo.size(dim) < 2:
            return None
        s = b.slot(name, STREAM[dim], CAT_COLL, base, dim=dim, tag=tag, **kw)
        steps.append(("coll", s, dim))
        return s

    # Step 5 prologue: zero the gradient buffers, copy the batch in.
    pre: list = []
    comp(pre, MEMSET, 40, kind=KIND_MEMSET, cat=CAT_MEMSET, op=OP_PRE)
    comp(pre, H2D, 300, kind=KIND_MEMCPY, cat=CAT_MEMCPY, op=OP_PRE)

    fwd_ops, bwd_ops = [], []
    for m in range(M):
        kw = dict(op=OP_F, mb=m)
        st: list = []
        if topo.pp > 1:
            s = b.slot(SENDRECV, STREAM["pp_prev"], CAT_P2P, 120, dim="pp", tag=TAG_RECV,
                       where=NOT_FIRST, **kw)
            st.append(("recv", s, "F"))
        comp(st, EMBED, 30, where=FIRST, **kw)
        for layer in range(L):
            kw["layer"] = layer
            comp(st, LN_FWD, 15, **kw)
            comp(st, GEMM_FWD, 150, tag=TAG_ATTN, **kw)
            coll(st, AG, "cp", 60, **kw)
            comp(st, FLASH_FWD, 220, tag=TAG_ATTN, **kw)
            comp(st, GEMM_FWD, 60, tag=TAG_ATTN, **kw)
            coll(st, AR_BF16, "tp", 80, **kw)
            comp(st, ADD, 8, **kw)
            comp(st, LN_FWD, 15, **kw)
            if moe:
                comp(st, GEMM_FWD, 20, **kw)  # router
                comp(st, TOPK, 12, **kw)
                comp(st, PERMUTE, 25, **kw)
                coll(st, SENDRECV, "ep", 150, tag=TAG_A2A, **kw)
                comp(st, EXPERT_FWD, 200, tag=TAG_EXPERT, **kw)
                comp(st, GELU, 25, tag=TAG_EXPERT, **kw)
                comp(st, EXPERT_FWD, 100, tag=TAG_EXPERT, **kw)
                coll(st, SENDRECV, "ep", 150, tag=TAG_A2A, **kw)
                comp(st, UNPERMUTE, 25, **kw)
            else:
                comp(st, GEMM_FWD, 260, tag=TAG_MLP, **kw)
                comp(st, GELU, 30, tag=TAG_MLP, **kw)
                comp(st, GEMM_FWD, 130, tag=TAG_MLP, **kw)
            coll(st, AR_BF16, "tp", 80, **kw)
            comp(st, ADD, 8, **kw)
        kw["layer"] = -1
        comp(st, GEMM_FWD, 400, where=LAST, **kw)  # LM head
        comp(st, CE_FWD, 40, where=LAST, **kw)
        if topo.pp > 1:
            s = b.slot(SENDRECV, STREAM["pp_next"], CAT_P2P, 120, dim="pp", tag=TAG_SEND,
                       where=NOT_LAST, **kw)
            st.append(("send", s, "F"))
        fwd_ops.append(st)

        kw = dict(op=OP_B, mb=m)
        st = []
        if topo.pp > 1:
            s = b.slot(SENDRECV, STREAM["pp_next"], CAT_P2P, 120, dim="pp", tag=TAG_RECV,
                       where=NOT_LAST, **kw)
            st.append(("recv", s, "B"))
        comp(st, CE_BWD, 40, where=LAST, **kw)
        comp(st, GEMM_DGRAD, 400, where=LAST, **kw)
        comp(st, GEMM_WGRAD, 400, where=LAST, **kw)
        for layer in reversed(range(L)):
            kw["layer"] = layer
            if moe:
                coll(st, SENDRECV, "ep", 150, tag=TAG_A2A, **kw)
                comp(st, EXPERT_DGRAD, 100, tag=TAG_EXPERT, **kw)
                comp(st, EXPERT_WGRAD, 100, tag=TAG_EXPERT, **kw)
                comp(st, GELU_BWD, 35, tag=TAG_EXPERT, **kw)
                comp(st, EXPERT_DGRAD, 200, tag=TAG_EXPERT, **kw)
                comp(st, EXPERT_WGRAD, 200, tag=TAG_EXPERT, **kw)
                coll(st, SENDRECV, "ep", 150, tag=TAG_A2A, **kw)
                comp(st, PERMUTE, 25, **kw)
                comp(st, GEMM_DGRAD, 20, **kw)
            else:
                comp(st, GEMM_DGRAD, 130, tag=TAG_MLP, **kw)
                comp(st, GEMM_WGRAD, 130, tag=TAG_MLP, **kw)
                comp(st, GELU_BWD, 40, tag=TAG_MLP, **kw)
                comp(st, GEMM_DGRAD, 260, tag=TAG_MLP, **kw)
                comp(st, GEMM_WGRAD, 260, tag=TAG_MLP, **kw)
            coll(st, AR_BF16, "tp", 80, **kw)
            comp(st, LN_BWD, 25, **kw)
            comp(st, GEMM_DGRAD, 60, tag=TAG_ATTN, **kw)
            comp(st, GEMM_WGRAD, 60, tag=TAG_ATTN, **kw)
            comp(st, FLASH_BWD, 500, tag=TAG_ATTN, **kw)
            coll(st, RS_BF16, "cp", 60, **kw)
            comp(st, GEMM_DGRAD, 150, tag=TAG_ATTN, **kw)
            comp(st, GEMM_WGRAD, 150, tag=TAG_ATTN, **kw)
            coll(st, AR_BF16, "tp", 80, **kw)
            comp(st, LN_BWD, 25, **kw)
            st.append(("ready", layer))
        kw["layer"] = -1
        comp(st, EMBED_BWD, 60, where=FIRST, **kw)
        if topo.pp > 1:
            s = b.slot(SENDRECV, STREAM["pp_prev"], CAT_P2P, 120, dim="pp", tag=TAG_SEND,
                       where=NOT_FIRST, **kw)
            st.append(("send", s, "B"))
        bwd_ops.append(st)

    # Step 5: one gradient bucket per layer, the last one smaller (partial bucket).
    buckets, bucket_layer = [], []
    if topo.dp > 1:
        for i, layer in enumerate(reversed(range(L))):
            size = 0.45 if (i == L - 1 and L > 1) else 1.0
            buckets.append(b.slot(RS_F32, STREAM["dp"], CAT_COLL, 600 * size, dim="dp",
                                  op=OP_BUCKET, layer=layer))
            bucket_layer.append(layer)
    # Optimizer work and the parameter all-gather scale with the parameters (layers).
    post: list = []
    comp(post, L2NORM, 30 * L, op=OP_POST)
    coll(post, AR_F32, MP, 30, op=OP_POST)
    comp(post, ADAM, 150 * L, op=OP_POST)
    comp(post, ADAM, 60 * L, op=OP_POST)
    coll(post, AG, "dp", 350 * L, op=OP_POST)
    comp(post, D2H, 20, kind=KIND_MEMCPY, cat=CAT_MEMCPY, op=OP_POST)

    rows = b.rows
    arr = lambda i, dt: np.array([r[i] for r in rows], dtype=dt)  # noqa: E731
    where = arr(10, np.int64)
    stage = np.arange(topo.pp)[:, None]
    present = np.ones((topo.pp, len(rows)), dtype=bool)
    present &= ~((where == NOT_FIRST) & (stage == 0))
    present &= ~((where == NOT_LAST) & (stage == topo.pp - 1))
    present &= ~((where == FIRST) & (stage != 0))
    present &= ~((where == LAST) & (stage != topo.pp - 1))

    programs = tuple(_stage_program(s, present[s], fwd_ops, bwd_ops, topo.pp, M) for s in range(topo.pp))
    phases = [PhaseDef("dataloader", clock=PHASE_CLOCK_CPU)]
    phases += [PhaseDef("forward", m) for m in range(M)]
    phases += [PhaseDef("backward", m) for m in range(M)]
    phases += [PhaseDef("self_attention"), PhaseDef("moe_experts" if moe else "mlp")]
    if moe:
        phases.append(PhaseDef("ep-alltoall", stream=STREAM["ep"]))
    if topo.pp > 1:
        phases += [PhaseDef("pp-recv", stream=STREAM["pp_prev"]), PhaseDef("pp-send", stream=STREAM["pp_next"])]
    if topo.dp > 1:
        phases.append(PhaseDef("dp-allreduce", stream=STREAM["dp"]))
    phases.append(PhaseDef("optimizer"))
    return Template(
        names=tuple(b.names), name_id=arr(0, np.uint32), stream=arr(1, np.uint32),
        kind=arr(2, np.uint8), cat=arr(3, np.int64), base_us=arr(4, np.float64),
        dim=tuple(r[5] for r in rows), tag=arr(6, np.int64), op=arr(7, np.int64),
        mb=arr(8, np.int64), layer=arr(9, np.int64), present=present, programs=programs,
        pre=_filter(pre, present.all(axis=0)), buckets=tuple(buckets),
        bucket_layer=tuple(bucket_layer), post=_filter(post, present.all(axis=0)),
        phases=tuple(phases), moe=moe, micro_batches=M, layers=L,
    )


def _filter(steps, present) -> tuple:
    """Drop the slots a stage does not run; compute runs become index arrays."""
    out = []
    for st in steps:
        if st[0] == "comp":
            keep = [s for s in st[1] if present[s]]
            if keep:
                out.append(("comp", np.asarray(keep, dtype=np.int64)))
        elif st[0] == "ready":
            out.append(st)
        elif present[st[1]]:
            out.append(st)
    # merge compute runs that became adjacent
    merged: list = []
    for st in out:
        if merged and st[0] == "comp" and merged[-1][0] == "comp":
            merged[-1] = ("comp", np.concatenate([merged[-1][1], st[1]]))
        else:
            merged.append(st)
    return tuple(merged)


def one_f_one_b(stage: int, pp: int, micro_batches: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order of one stage: warm-up forwards,
    steady one-forward-one-backward, cool-down backwards."""
    warm = min(pp - stage - 1, micro_batches)
    order = [("F", m) for m in range(warm)]
    for i in range(micro_batches - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", m) for m in range(micro_batches - warm, micro_batches)]
    return order


def _stage_program(s, present, fwd_ops, bwd_ops, pp, M) -> tuple:
    ops = {"F": fwd_ops, "B": bwd_ops}
    return tuple((op, m, _filter(ops[op][m], present)) for op, m in one_f_one_b(s, pp, M))
