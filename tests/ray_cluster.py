"""A small multi-node Ray cluster on this machine, driven over stdin (tests only).

Run inside a network namespace with only loopback up, where Ray binds and
advertises 127.0.0.1. Prints one JSON line per command:

* start: ``{"address": "127.0.0.1:PORT", "nodes": [worker node ids], "session": dir}``;
  worker ``i`` is named ``w{i}`` (``HARBOR_EXEC_NODE_NAME``, as a host name would)
* ``add [NAME]``: a worker node with the trial resource; ``{"node": id}``
* ``remove ID``: kill that worker node (SIGKILL, as a crashed machine); ``{"removed": id}``
* ``gcs stop`` / ``gcs cont``: freeze / resume the head's GCS (SIGSTOP / SIGCONT)
* ``quit``: tear everything down.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from ray.cluster_utils import Cluster

SLOTS = 4


def main() -> None:
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "object_store_memory": 80 * 1024 * 1024,
            "node_ip_address": "127.0.0.1",
            "_system_config": {
                # A killed node is noticed within a couple of seconds.
                "health_check_period_ms": 500,
                "health_check_failure_threshold": 3,
                "health_check_initial_delay_ms": 0,
            },
        },
    )
    nodes = {}

    def add(name: str) -> str:
        node = cluster.add_node(
            num_cpus=1,
            resources={"harbor_exec_trial": SLOTS},
            object_store_memory=80 * 1024 * 1024,
            node_ip_address="127.0.0.1",
            env_vars={"HARBOR_EXEC_NODE_NAME": name},
        )
        nodes[node.node_id] = node
        return str(node.node_id)

    started = [add(f"w{i}") for i in range(workers)]
    cluster.wait_for_nodes()
    head = cluster.head_node
    assert head is not None
    session = head.get_session_dir_path()
    print(
        json.dumps({"address": cluster.address, "nodes": started, "session": session}), flush=True
    )
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "add":
            node_id = add(words[1] if len(words) > 1 else f"w{len(nodes)}-{os.urandom(2).hex()}")
            cluster.wait_for_nodes()
            print(json.dumps({"node": node_id}), flush=True)
        elif words[0] == "remove":
            cluster.remove_node(nodes.pop(words[1]), allow_graceful=False)
            print(json.dumps({"removed": words[1]}), flush=True)
        elif words[0] == "gcs":
            gcs = cluster.head_node.all_processes["gcs_server"][0].process
            os.kill(gcs.pid, signal.SIGSTOP if words[1] == "stop" else signal.SIGCONT)
            print(json.dumps({"gcs": words[1], "pid": gcs.pid}), flush=True)
        elif words[0] == "quit":
            break
    cluster.shutdown()
    print(json.dumps({"quit": True}), flush=True)


if __name__ == "__main__":
    main()
