"""Weight sync across hosts: cross-host device_put (whole hosts per side) vs the per-host all-gather
path vs a plain socket copy of the same bytes, full weights vs LoRA-only, in one run.

  python benchmarks/multihost.py [--out FILE] [--quick] [--mb 32]

Starts 2 processes on 127.0.0.1 (one jax.distributed job, 4 virtual CPU devices each) that run
three phases in turn, each timed on the receiving process (median of --repeats after a warm-up):
  * `by_host`: process 0 is a learner host (FSDP over its 4 devices), process 1 a sampler host
    (4 replicas): `hosts.transfer.send_across_hosts` with the default 256 MiB buckets;
  * `per_host`: the per-host split of today (2 sampler + 2 learner devices per process, one learner
    mesh over both): `rl.weight_sync.sync`, which all-gathers and copies locally on each host;
  * `socket`: the bytes the by-host sync delivers to one replica, sent once over a TCP socket on
    127.0.0.1 between the same two processes (the floor of a host-to-host copy here);
  * `raw_device_put`: the same bytes as one array, one cross-host `jax.device_put` from one device
    of process 0 to one of process 1: JAX's transfer alone, without the sync's gather, staging,
    acknowledgements and fan-out.
Full weights are synthetic float32 matrices of about --mb MB (a transformer's shapes: [d, 4d] and
[4d, d] per layer); LoRA-only is rank-8 A and B matrices for each of them (packed into one buffer).
bytes/s counts one copy of the weights per sync (each side also fans it out to 4 replicas).
All processes share the machine's cores, so this compares paths, not a network.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import harness


def _flags(p):
  p.add_argument("--mb", type=float, default=32.0, help="full weights, MB (float32)")
  p.add_argument("--repeats", type=int, default=5, help="timed syncs per path (after one warm-up)")
  p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # set for the 2 processes


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _tree(mb: float, np):
  d = 256
  layers = max(1, int(mb * 2**20 / (8 * d * d * 4)))
  rng = np.random.default_rng(0)
  full = {f"layer{i}": {"up": rng.standard_normal((d, 4 * d), np.float32),
                        "down": rng.standard_normal((4 * d, d), np.float32)} for i in range(layers)}
  lora = {f"layer{i}": {name: {"a": np.zeros((shape[0], 8), np.float32), "b": np.zeros((8, shape[1]), np.float32)}
                        for name, shape in (("up", (d, 4 * d)), ("down", (4 * d, d)))} for i in range(layers)}
  return full, lora


def _nbytes(tree, np) -> int:
  import jax
  return sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(tree))


def worker(args):
  import numpy as np
  from tunixlike import distributed, mesh as mesh_lib
  from tunixlike.hosts import kv, layout as layout_lib, transfer
  me = int(os.environ["JAX_PROCESS_ID"])
  assert distributed.initialize(distributed.DistributedConfig(timeout_s=120), cross_host_transfers=True)
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  client = kv.client()
  full_host, lora_host = _tree(args.mb, np)
  result = {}

  def fresh(tree):  # a new learner copy per sync, as after a train step
    return jax.tree.map(lambda x: x + 0, tree)

  def time_path(name, sync, make):
    times = []
    for r in range(args.repeats + 1):
      tree = make()
      jax.block_until_ready(tree)
      client.wait_at_barrier(f"bench/{name}/{r}", 120_000)
      t = time.perf_counter()
      out = sync(tree)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - t)
    client.wait_at_barrier(f"bench/{name}/end", 120_000)
    return statistics.median(times[1:])

  for kind, host_tree in (("full", full_host), ("lora", lora_host)):
    nbytes = _nbytes(host_tree, np)
    # by host: process 0 learner host, process 1 sampler host
    layout = layout_lib.make_host_layout(1)
    spec = jax.tree.map(lambda _: P(), host_tree)
    if me == 0:
      src = jax.device_put(host_tree, jax.tree.map(
          lambda x: NamedSharding(layout.learner, P("fsdp") if x.shape[0] % 4 == 0 and kind == "full" else P()),
          host_tree))
      make = lambda: fresh(src)
    else:
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_tree)
      make = lambda: abstract
    calls = itertools.count()  # both processes sync in the same order: the same key per sync
    s = time_path(f"by_host/{kind}", lambda t: transfer.send_across_hosts(
        t, spec, layout=layout, version=next(calls), timeout_s=120, tag=f"bench/{kind}")[0], make)
    result[f"by_host_{kind}_s"] = s
    result[f"by_host_{kind}_bytes_per_s"] = nbytes / s
    # per host: today's split, every process both sides
    from tunixlike.rl import weight_sync
    meshes = mesh_lib.make_meshes(4, 4)
    src = jax.device_put(host_tree, jax.tree.map(
        lambda x: NamedSharding(meshes.learner, P("fsdp") if kind == "full" else P()), host_tree))
    targets = jax.tree.map(lambda _: NamedSharding(meshes.sampler, P()), host_tree)
    s = time_path(f"per_host/{kind}", lambda t: weight_sync.sync(t, targets)[0], lambda: fresh(src))
    result[f"per_host_{kind}_s"] = s
    result[f"per_host_{kind}_bytes_per_s"] = nbytes / s
    result[f"{kind}_bytes"] = nbytes
  # socket: the full weights' bytes once from process 0 to process 1
  payload = b"".join(np.ascontiguousarray(x).tobytes() for x in jax.tree.leaves(full_host))
  times = []
  for r in range(args.repeats + 1):
    if me == 1:
      srv = socket.create_server(("127.0.0.1", 0))
      client.key_value_set(f"bench/socket/{r}", str(srv.getsockname()[1]))
      conn, _ = srv.accept()
      buf, got = bytearray(len(payload)), 0
      t = time.perf_counter()
      view = memoryview(buf)
      while got < len(payload):
        got += conn.recv_into(view[got:])
      times.append(time.perf_counter() - t)
      conn.sendall(b"k")
      conn.close()
      srv.close()
    else:
      port = int(client.blocking_key_value_get(f"bench/socket/{r}", 60_000))
      with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(payload)
        c.recv(1)
    client.wait_at_barrier(f"bench/socket/{r}/end", 60_000)
  result["socket_full_s"] = statistics.median(times[1:]) if me == 1 else None
  # raw: the same bytes as one array by one cross-host device_put, one device to one device (no
  # gather, staging, acknowledgement or fan-out: what JAX's transfer itself costs)
  one = [NamedSharding(jax.sharding.Mesh(np.array([d for d in jax.devices() if d.process_index == p][:1]), ("x",)), P())
         for p in (0, 1)]
  n = len(payload) // 4
  raw = []
  for r in range(args.repeats + 1):
    if me == 0:
      x = jax.device_put(np.full((n,), r, np.float32), one[0]).block_until_ready()
    else:
      x = jax.make_array_from_single_device_arrays((n,), one[0], [], dtype=np.float32)
    client.wait_at_barrier(f"bench/raw/{r}", 60_000)
    t = time.perf_counter()
    y = jax.device_put(x, one[1])
    if me == 1:
      y.block_until_ready()
      raw.append(time.perf_counter() - t)
    client.wait_at_barrier(f"bench/raw/{r}/end", 60_000)  # the source stays alive until it arrived
  if me == 1:
    result["socket_full_bytes_per_s"] = len(payload) / result["socket_full_s"]
    result["raw_device_put_full_s"] = statistics.median(raw[1:])
    result["raw_device_put_full_bytes_per_s"] = len(payload) / result["raw_device_put_full_s"]
    print("RESULT " + json.dumps(result), flush=True)
  client.wait_at_barrier("bench/end", 60_000)


def main():
  args = harness.parse(__doc__, _flags)
  if args.quick:
    args.mb, args.repeats = 4.0, 2
  if args.worker is not None:
    return worker(args)
  port = _free_port()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  procs = []
  for i in range(2):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": harness.xla_flags(4),
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i),
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, os.path.abspath(__file__), "--worker", str(i), "--mb", str(args.mb),
            "--repeats", str(args.repeats)]
    procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = [p.communicate(timeout=900)[0] for p in procs]
  lines = [l for l in outs[1].splitlines() if l.startswith("RESULT ")]
  if any(p.returncode for p in procs) or not lines:
    raise SystemExit("benchmark workers failed:\n" + "\n".join(o[-3000:] for o in outs))
  r = json.loads(lines[0][len("RESULT "):])
  r["by_host_vs_socket_bandwidth"] = r["by_host_full_bytes_per_s"] / r["socket_full_bytes_per_s"]
  r["raw_device_put_vs_socket_bandwidth"] = r["raw_device_put_full_bytes_per_s"] / r["socket_full_bytes_per_s"]
  r["by_host_vs_per_host_full_time"] = r["by_host_full_s"] / r["per_host_full_s"]
  r["by_host_full_vs_lora_time"] = r["by_host_full_s"] / r["by_host_lora_s"]
  r.update(mb=args.mb, repeats=args.repeats, processes=2, devices_per_process=4)
  harness.report(r, args)


if __name__ == "__main__":
  main()
