"""What of the agent's environment never reaches the processes of a job (torchrun and its
ranks, a script's processes, a pip environment's build)."""

from __future__ import annotations

# Inherited variables that would confuse torchrun or its ranks.
DIST_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "CUDA_VISIBLE_DEVICES",
)
# Secrets of the agent or launcher (and of a service it runs beside) that no rank may see.
SECRET_VARS = ("TORCHYARD_TOKEN", "TORCHYARD_LAUNCH_TOKEN", "TORCHYARD_DATABASE_URL")
