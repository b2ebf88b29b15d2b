"""Every environment variable trainscope reads, named once (STYLE.md point 4).

Resolution order everywhere: CLI flag, then environment variable, then default.
"""
ENABLED = "TRAINSCOPE_ENABLED"            # "0" turns the in-process collector into a no-op
PROCESSOR = "TRAINSCOPE_PROCESSOR"        # gRPC target of the host's processor
JOB_ID = "TRAINSCOPE_JOB_ID"              # job id; default from the launcher (TORCHELASTIC_RUN_ID)
TOPOLOGY = "TRAINSCOPE_TOPOLOGY"          # "tp=2,pp=4,ep=1,cp=1,order=tp-cp-ep-dp-pp"
HOME = "TRAINSCOPE_HOME"                  # where the embedded default keeps its store and traces
KAFKA_BOOTSTRAP = "KAFKA_BOOTSTRAP"       # bootstrap servers of a real Kafka cluster
PROMETHEUS_PORT = "TRAINSCOPE_PROMETHEUS_PORT"
REMOTE_WRITE_URL = "TRAINSCOPE_REMOTE_WRITE_URL"
# Enablement of the in-process collectors (collector/launch.py). The start-up
# hook (collector/bootstrap/_trainscope_boot.py) is stdlib-only and names its
# own few (AUTOSTART, MATCH, RANK_PID, RUN_PID) itself.
RUN_DIR = "TRAINSCOPE_RUN_DIR"            # where ranks announce themselves and leave their counters
STACKS = "TRAINSCOPE_STACKS"              # "0" off, "1" local rank 0 starts the sidecar, "external"
STACKS_WINDOW_S = "TRAINSCOPE_STACKS_WINDOW_S"
CPU_OPS = "TRAINSCOPE_CPU_OPS"            # "0" off, or "period_s=30,window_s=0.05,first_after_s=5"
CUPTI = "TRAINSCOPE_CUPTI"                # "0" never try CUPTI
HOOKS = "TRAINSCOPE_HOOKS"                # "0" off, or a subset "dataloader,optimizer,module,collectives"
SHUTDOWN_TIMEOUT_S = "TRAINSCOPE_SHUTDOWN_TIMEOUT_S"
SHIP_INTERVAL_S = "TRAINSCOPE_SHIP_INTERVAL_S"  # phases/iterations handed to the exporter at most this often
NCCL_TIMING = "TORCH_NCCL_ENABLE_TIMING"  # read by PyTorch: NCCL work times itself on its stream
# Set by torchrun / torch.distributed launchers; read, never written.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LAUNCHER_RUN_ID = "TORCHELASTIC_RUN_ID"
