"""Script jobs across two nodes in network namespaces (2×1, both launch modes, every
node's outputs kept). The finetune-resnet example runs in tests/e2e/test_models_script.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.config import Settings
from tests.e2e.test_script_jobs import SCRIPT_SETTINGS
from tests.support.netns import NetnsCluster, require_netns
from tests.support.script_helpers import PROBE, script_env

TORCHRUN = ["torchrun", "--nnodes", "$NNODES", "--nproc-per-node", "$NPROC_PER_NODE", "--node-rank",
            "$NODE_RANK", "--master-addr", "$MASTER_ADDR", "--master-port", "$MASTER_PORT", "probe.py"]  # fmt: skip


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    values = {**SCRIPT_SETTINGS, "master_port_min": 26500, "master_port_max": 26999}
    settings: Settings = make_settings(**values)
    return settings


@pytest.fixture
def netns_hosts() -> Iterator[NetnsCluster]:
    require_netns()
    with NetnsCluster(2) as cluster:
        yield cluster


def test_two_nodes_in_network_namespaces_both_launch_modes(
    netns_hosts: NetnsCluster, settings: Settings, tmp_path: Path
) -> None:
    with script_env(settings, tmp_path, host=netns_hosts.gateway) as env:
        names = []
        for host in netns_hosts.hosts:
            names.append(f"{host.name}-node")
            env.agent(names[-1], slots=1, wrap=host.argv([]), env={"NO_PROXY": "*"})
        code = env.upload_code({"probe.py": PROBE})
        two_nodes = {"node_count": 2, "process_count_per_node": 1}
        # Node 1 writes one more output file 5 s after node 0 ended: the job succeeds only
        # once every node's outputs are in, so its late upload is kept, not refused.
        late = {"variables": {"PROBE_LATE_RANK": "1", "PROBE_LATE_S": "5"}}
        per_process = env.submit(
            code, ["python", "probe.py"], resources=two_nodes, outputs="all", environment=late
        )
        job = env.wait(per_process)
        assert job["status"] == "succeeded", job
        files = env.outputs(per_process)
        assert {name.split("/")[0] for name in files} == {"node-0", "node-1"}  # every node's outputs
        assert files["node-1/late.txt"] == b"rank 1, after the others ended"
        seen = env.seen(per_process)
        addresses = {h.address for h in netns_hosts.hosts}
        for rank, s in seen.items():
            assert (s["RANK"], s["NODE_RANK"], s["WORLD_SIZE"], s["LOCAL_RANK"]) == (
                str(rank),
                str(rank),
                "2",
                "0",
            )
            assert s["MASTER_ADDR"] in addresses and s["all_reduce"] == 3.0
        # Each node's ./logs files are streams named by its node rank.
        streams = env.user.get(f"/v1/jobs/{per_process}/logs/streams").json()["streams"]
        files_of = {s["name"]: s["node"] for s in streams if s["name"].startswith("file-")}
        assert files_of["file-0/rank-0.txt"] == names[0] and files_of["file-1/rank-1.txt"] == names[1]
        assert env.log(per_process, stream="file-1/rank-1.txt") == "extra log of rank 1"

        per_node = env.submit(code, TORCHRUN, resources=two_nodes, distribution={"launch": "per_node"})
        job = env.wait(per_node)
        assert job["status"] == "succeeded", job
        seen = env.seen(per_node)  # node 0's outputs only (the default)
        assert list(seen) == [0]
        assert (seen[0]["NNODES"], seen[0]["NPROC_PER_NODE"], seen[0]["all_reduce"]) == ("2", "1", 3.0)
