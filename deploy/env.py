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
# Set by torchrun / torch.distributed launchers; read, never written.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LAUNCHER_RUN_ID = "TORCHELASTIC_RUN_ID"
