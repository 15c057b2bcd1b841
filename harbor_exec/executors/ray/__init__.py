"""Trials on the nodes of a Ray cluster (the optional extra ``harbor-exec[ray]``).

``RayExecutor`` is a ``TrialExecutor``: the server stays the single control plane
(admission, queue, status, cancel); each trial runs on a Ray node with a Docker engine.

* **Nodes.** A node offers trial slots through the custom resource
  ``harbor_exec_trial`` (``ray start --resources '{"harbor_exec_trial": 16}'``). For
  each such node the executor starts one long-lived actor (``NodeAgent``) pinned to it;
  the actor wraps a ``LocalExecutor``, so it owns that node's Docker runtime, its
  image cache, its reaper and the model relays of its trials. The node table is
  re-read every second, so a node that joins takes trials without a restart.
* **Placement.** The server counts slots itself (the resource's amount on each
  node) and calls the node's actor directly: one Ray task per trial would cost a
  worker process per running trial. A trial prefers a node that already has its
  image (soft affinity), else the least loaded node with a free slot.
* **No shared filesystem.** A trial travels as its plain ``TrialSpec``; the task
  snapshot, the wheelhouse and the bundle's files go through Ray's object store
  once per content key, as references; a node materializes each under its cache
  directory by key, once, and builds the trial from the spec with
  ``trial_request``, as the local executor does. The result, the exchange files'
  output and the model usage come back as values; the trial directory's files
  (kept logs, artifacts; bounded by the sandbox policy) as one tar, written under
  the server's trials directory, with ``result.json``'s ``config.node`` naming the node.
* **Secrets.** The trial's ``TrialSecrets`` (the model endpoint with the trainer's
  key, the scrub list, the agent's and the verifier's input) are sealed for the
  target actor (``sealing``): each actor makes an X25519 key pair in memory at
  start and publishes only the public key; the server seals each call with a fresh
  ephemeral key (X25519 → HKDF-SHA256 → AES-256-GCM, i.e. ECIES). What Ray stores,
  logs, spills or shows is ciphertext; only that actor's process can open it.
* **Faults.** A node that dies fails its trials with ``RayNodeLostError``
  (``internal_error``, "Ray node N was lost during the agent phase"), once; its
  containers belong to a dead process and are reaped by any node's reaper sharing
  its engine, or by its own when it returns. ``available()`` explains why no trial
  can start (cluster unreachable, no node with slots).
"""

# Nothing here imports ray (or cryptography) before it is used: both come with the
# optional ``ray`` extra.
from harbor_exec.errors import RayNodeLostError, RayUnavailableError
from harbor_exec.executors.ray.driver import (
    NAMESPACE,
    TRIAL_RESOURCE,
    RayExecutor,
    json_report,
    wait_for_nodes,
)
from harbor_exec.executors.ray.node import MAX_RESULT_BYTES, NODE_NAME_ENV, NodeAgent
from harbor_exec.executors.ray.sealing import Opener, seal
from harbor_exec.executors.ray.transfer import tar_dir, untar

__all__ = [
    "MAX_RESULT_BYTES",
    "NAMESPACE",
    "NODE_NAME_ENV",
    "TRIAL_RESOURCE",
    "NodeAgent",
    "Opener",
    "RayExecutor",
    "RayNodeLostError",
    "RayUnavailableError",
    "json_report",
    "seal",
    "tar_dir",
    "untar",
    "wait_for_nodes",
]
