"""Elastic GPU calls through a coordinator (issue 33 item 2 with item 1's cluster services):
a real coordinator and a node with two simulated GPUs in this process
(tests/cluster_harness.py), real torch workers on the node."""

from __future__ import annotations

from pathlib import Path

from cluster_harness import InProcessCluster, check_clean, stop_all

SERVICES = Path(__file__).parent / "data" / "services"
COORDINATOR = """
[sched]
coalesce_ms = 1.0

[cluster]
heartbeat_s = 0.1
heartbeat_timeout_s = 2.0
"""
NODE = """
[gpu]
simulated = { count = 2, mem_gb = 0.1, h2d_gbps = 1 }
nvml = false
"""
X = {"x": [3, -1, 4, 1]}


def test_an_elastic_call_spans_a_nodes_gpus_and_a_new_eff_reaches_the_nodes(
    tmp_path: Path,
) -> None:
    """Registered at the coordinator with eff 1:1,2:1.3, an idle call runs on both GPUs of
    node a (two workers there) and answers as a call pinned to one GPU; `service.set_eff`
    at the coordinator is what `service list` shows, from the coordinator and from the
    node's own socket."""
    with InProcessCluster(tmp_path, env={"TANGRAM_VALIDATE": "1"}) as here:
        coord = here.coordinator(COORDINATOR)
        node = here.node(coord, "a", config=NODE)
        try:
            with coord.client(timeout_s=120) as c:
                c.service_register(
                    "mlp",
                    mem_gb=0.01,
                    entry="mlp_services:small",
                    path=str(SERVICES),
                    gpus=[1, 2],
                    eff="1:1,2:1.3",
                )
                idle = c.call("mlp", X)
                one = c.call("mlp", X, gpus=1)
                assert idle.ok and (idle.node, idle.gpus) == ("a", (0, 1)), idle
                assert one.ok and len(one.gpus) == 1, one
                assert idle.result is not None and one.result is not None
                assert idle.result["y"] == one.result["y"]
                pair = [
                    r
                    for r in c.service_list()[0]["replicas"]
                    if r["gpus"] == [0, 1] and r["node"] == "a"
                ]
                assert len(pair) == 1 and len(pair[0]["workers"]) == 2, pair
                assert c.service_set_eff("mlp", {1: 1.0, 2: 1.1})["eff"] == "1:1,2:1.1"
            with node.client(timeout_s=120) as c:
                assert [r["eff"] for r in c.service_list()] == ["1:1,2:1.1"]
                again = c.call("mlp", X)
                assert again.ok and again.result is not None
                assert again.result["y"] == one.result["y"]
        finally:
            stop_all([node, coord])
        check_clean(coord, node)
