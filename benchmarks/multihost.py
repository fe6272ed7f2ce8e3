"""Whole sampler hosts apart from learner hosts: the weight sync by cross-host device_put vs the per-host
all-gather path vs a plain socket copy of the same bytes, full weights vs LoRA-only, where the time
goes, two sampler hosts fed directly vs through a relay, and the RL step of both layouts, in one run.

  python benchmarks/multihost.py [--out FILE] [--quick] [--mb 64] [--width 1024] [--repeats 5]
      [--rl-steps 10] [--transfer-size BYTES] [--connections N] [--bucket-mb MIB] [--parts 1,2,3]

Part 1, 2 processes on 127.0.0.1 (one jax.distributed job, 4 virtual CPU devices each), each path
timed on the receiving process (median of --repeats after a warm-up):
  * `by_host`: process 0 is a learner host (FSDP over its 4 devices), process 1 a sampler host
    (4 replicas): `hosts.transfer.send_across_hosts` with 256 MiB buckets (--bucket-mb); then
    --repeats more syncs with `profile=` give the median seconds of each stage on each side (pack
    and ack on the learner host; wait_for_pack, transfer, gather, unpack and place on the sampler host);
  * `by_host_tp`: the same, the sampler host tensor-parallel over its 4 devices (`sampler_tensor=4`:
    up [d, 4d] split by columns, down [4d, d] by rows): each array crosses in that layout, each
    device receiving its part (no fan-out: the sampler host writes the bytes once, as the socket
    copy does); the learner host reshards up (its FSDP rows -> columns) and sends down as it is;
    also profiled (pack, ack; wait_for_pack, transfer, place);
  * `by_host_lora`: the LoRA adapters alone, to the replicated sampler host (they are small: one whole
    buffer, the same in either layout), profiled too (pack, ack; transfer, place: no "packed" flag);
    `by_host_full_vs_lora_time` and `by_host_tp_full_vs_lora_time` compare it with each full sync;
  * `per_host`: the per-host split (2 sampler + 2 learner devices per process, one learner mesh
    over both): `rl.weight_sync.sync`, which all-gathers and copies locally on each host;
  * `socket`: the bytes the by-host sync delivers, sent once over a TCP socket on 127.0.0.1 between
    the same two processes (the floor of a host-to-host copy here);
  * `raw_device_put`: the same bytes as one array, one cross-host `jax.device_put`, from one device
    to one device (`raw_1dev`) and split over the 4 devices of each side (`raw_4dev`, what the sync
    sends): JAX's transfer alone, without packing, acknowledgement or unpacking;
  * `fan_out_4dev`: on the sampler host alone, the same bytes split over its 4 devices made whole
    on each: an all-gather program (`all_gather`, what the sampler host ran until 2026-11-28) vs
    `hosts.transfer.unpack` (`copies`: gathered on one device, cut there, copied to the others).
Part 2, 3 processes (1 learner host, 2 sampler hosts), the full weights: `direct` (the learner host
sends to each sampler host) vs `relay` (it sends to the first, which sends on to the second), timed
until both sampler hosts have them; `fan_out_winner` says which was faster.
Part 3, the same RL job twice on 2 processes of 4 devices (4 sampler + 4 learner devices in all):
`layouts.run` (what `python -m tunixlike.train` runs) on the tiny addition model, --rl-steps async
GRPO steps (`rl.max_staleness=1`, 8 prompts x 8 samples per step; --quick: 4 x 4 in 32 decode slots,
one layer, 4 held-out prompts), `per_host` (each process 2 + 2 devices) vs `by_host`
(`mesh.sampler_hosts=1`: process 0 trains, process 1 decodes). `s_per_step`:
the median time between step records in metrics.jsonl after the first two (compilation);
`learner_busy_frac` and `sampler_busy_frac`: the runtime's own fractions (learner step time, the
driver's decode time, over the RL loop's wall clock) at the last step, on the by-host sampler host
its driver's at the last weight sync.

Each path's `*_cpu_s`: the median CPU seconds of one sync (one copy), both processes' summed (every
thread's); other jobs on the machine inflate it far less than the wall clock, so `*_vs_socket_cpu`
says what a path costs where the bandwidth ratio is mostly the load.

Full weights are synthetic float32 matrices of about --mb MB (a transformer's shapes: [d, 4d] and
[4d, d] per layer, d = --width); LoRA-only is rank-8 A and B matrices for each of them (d / 10 times
fewer bytes); `--mb 256` is the largest model recorded in docs/benchmarks.md (8 layers; about 4 GB
of peak memory in each of the two processes). bytes/s counts one copy of the weights per sync (the
sampler host also spreads it to its 4 replicas). --transfer-size and --connections set JAX's
transfer chunk size and the number of its data connections (`hosts.transfer_server.enable`; default:
the library's). All processes share the machine's cores, so this compares paths, not a network.
`max_process_rss_mb`: the largest worker's peak memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

import harness
import local_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flags(p):
  p.add_argument("--mb", type=float, default=64.0, help="full weights, MB (float32)")
  p.add_argument("--width", type=int, default=1024, help="the model width d: [d, 4d] and [4d, d] matrices")
  p.add_argument("--rl-steps", type=int, default=10, help="RL steps of each layout in part 3")
  p.add_argument("--repeats", type=int, default=5, help="timed syncs per path (after one warm-up)")
  p.add_argument("--transfer-size", type=int, default=None, help="JAX's transfer chunk, bytes")
  p.add_argument("--connections", type=int, default=None, help="JAX's transfer data connections")
  p.add_argument("--bucket-mb", type=float, default=None, help="the by-host sync's bucket, MiB (default: the library's)")
  p.add_argument("--timeout", type=float, default=600, help="seconds each part may take")
  p.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 1 for the two-process syncs alone")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "pair", "trio" or "rl", in the subprocesses
  p.add_argument("--layout", default=None, help=argparse.SUPPRESS)  # part 3's workers: "by_host" or "per_host"
  p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)  # part 3's workers


def _tree(mb: float, d: int, np):
  layers = max(1, int(mb * 2**20 / (8 * d * d * 4)))
  rng = np.random.default_rng(0)
  full = {f"layer{i}": {"up": rng.standard_normal((d, 4 * d), np.float32),
                        "down": rng.standard_normal((4 * d, d), np.float32)} for i in range(layers)}
  lora = {f"layer{i}": {name: {"a": np.zeros((shape[0], 8), np.float32), "b": np.zeros((8, shape[1]), np.float32)}
                        for name, shape in (("up", (d, 4 * d)), ("down", (4 * d, d)))} for i in range(layers)}
  return full, lora


def _start(args):
  """This worker's jax.distributed job with the transfer server; returns (process id, kv client)."""
  from tunixlike import distributed
  from tunixlike.hosts import kv, rendezvous, transfer_server
  me = int(os.environ["JAX_PROCESS_ID"])
  config = distributed.resolve(distributed.DistributedConfig(timeout_s=120))
  transfer_server.enable(config.coordinator_address, me, timeout_s=120, transfer_size=args.transfer_size,
                         connections=args.connections)
  assert rendezvous.initialize(config, rendezvous.Hello({}, 120))
  return me, kv.client()


def _both_cpu(client, name: str, me: int, cpu_s: float) -> float:
  """This process's CPU seconds plus the other one's (of 2), through the key-value store."""
  client.key_value_set(f"bench/{name}/cpu/{me}", repr(cpu_s))
  return sum(float(client.blocking_key_value_get(f"bench/{name}/cpu/{p}", 60_000)) for p in (0, 1))


def _timer(client, repeats: int, me: int):
  """time_path(name, run, prepare): runs `run(prepare())` 1 + repeats times, all processes starting
  together, the next only when all are done; returns (this process's median seconds after the
  warm-up, the median CPU seconds of each process summed over both: every thread's, which the
  other jobs on the machine do not inflate as they do the wall clock)."""
  import jax

  def time_path(name, run, prepare=lambda: None):
    print(f"PATH {name}", flush=True)  # where a hang is, in the failure's output
    times, cpu = [], []
    for r in range(repeats + 1):
      arg = prepare()
      jax.block_until_ready(arg)
      client.wait_at_barrier(f"bench/{name}/{r}", 120_000)
      t, c = time.perf_counter(), time.process_time()
      jax.block_until_ready(run(arg))
      times.append(time.perf_counter() - t)
      cpu.append(time.process_time() - c)
      # the next `prepare` only once every process is done: a learner host making its next copy
      # would otherwise share the cores with the sampler host still unpacking this one
      client.wait_at_barrier(f"bench/{name}/{r}/done", 120_000)
    client.wait_at_barrier(f"bench/{name}/end", 120_000)
    return statistics.median(times[1:]), _both_cpu(client, name, me, statistics.median(cpu[1:]))
  return time_path


def _bucket_bytes(args) -> int:
  from tunixlike.rl import weight_sync
  return weight_sync.DEFAULT_BUCKET_BYTES if args.bucket_mb is None else int(args.bucket_mb * 2**20)


def _learner_copy(tree, layout, fsdp: bool):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  return jax.device_put(tree, jax.tree.map(lambda x: NamedSharding(layout.learner, P("fsdp") if fsdp else P()), tree))


def pair_worker(args):
  """Part 1: process 0 learner host, process 1 sampler host."""
  import numpy as np
  me, client = _start(args)
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from tunixlike import mesh as mesh_lib
  from tunixlike.hosts import layout as layout_lib, transfer
  from tunixlike.rl import weight_sync
  time_path = _timer(client, args.repeats, me)
  full_host, lora_host = _tree(args.mb, args.width, np)
  result = {}
  fresh = lambda tree: jax.tree.map(lambda x: x + 0, tree)  # a new learner copy per sync, as after a step
  layout = layout_lib.make_host_layout(1, sampler_tensor=1, learner_tensor=1)
  tensor_layout = layout_lib.make_host_layout(1, sampler_tensor=4, learner_tensor=1)
  # the sampler's tensor-parallel layout of an MLP: up [d, 4d] split by columns, down [4d, d] by rows
  tensor_spec = {name: {"up": P(None, "tensor"), "down": P("tensor", None)} for name in full_host}
  variants = (("full", full_host, layout, jax.tree.map(lambda _: P(), full_host)),
              ("lora", lora_host, layout, jax.tree.map(lambda _: P(), lora_host)),
              ("tp_full", full_host, tensor_layout, tensor_spec))
  for kind, host_tree, host_layout, spec in variants:
    nbytes = sum(x.nbytes for x in jax.tree.leaves(host_tree))
    if me == 0:
      src = _learner_copy(host_tree, host_layout, fsdp=kind != "lora")
      make = lambda: fresh(src)
    else:
      make = lambda: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_tree)
    calls = itertools.count()  # every process syncs in the same order: the same key per sync
    sync = lambda t, profile=None: transfer.send_across_hosts(
        t, spec, layout=host_layout, version=next(calls), timeout_s=120, tag=f"bench/{kind}", profile=profile,
        bucket_bytes=_bucket_bytes(args))[0]
    s, result[f"by_host_{kind}_cpu_s"] = time_path(f"by_host/{kind}", sync, make)
    result[f"by_host_{kind}_s"], result[f"by_host_{kind}_bytes_per_s"] = s, nbytes / s
    # --repeats more syncs, each stage waited for and timed on both sides: medians
    profiles = []
    for r in range(args.repeats):
      tree = make()
      jax.block_until_ready(tree)
      client.wait_at_barrier(f"bench/profile/{kind}/{r}", 120_000)
      profiles.append({})
      jax.block_until_ready(sync(tree, profiles[-1]))
    mine = {k: statistics.median(p[k] for p in profiles) for k in profiles[0]}
    client.key_value_set(f"bench/profile/{kind}/{me}", json.dumps(mine))
    client.wait_at_barrier(f"bench/profile/{kind}/end", 120_000)
    if me == 1:
      stages = {**json.loads(client.blocking_key_value_get(f"bench/profile/{kind}/0", 60_000)), **mine}
      result[f"by_host_{kind}_stages_s"] = {k: round(v, 5) for k, v in stages.items()}
    if kind == "tp_full":
      continue  # the per-host split below is the replicated sampler's
    meshes = mesh_lib.make_meshes(4, 4, 1, 1, layout="split")  # the per-host split: every process both sides
    src = jax.device_put(host_tree, jax.tree.map(
        lambda x: NamedSharding(meshes.learner, P("fsdp") if kind == "full" else P()), host_tree))
    targets = jax.tree.map(lambda _: NamedSharding(meshes.sampler, P()), host_tree)
    s, result[f"per_host_{kind}_cpu_s"] = time_path(f"per_host/{kind}", lambda t: weight_sync.sync(t, targets)[0],
                                                    lambda: fresh(src))
    result[f"per_host_{kind}_s"], result[f"per_host_{kind}_bytes_per_s"] = s, nbytes / s
    result[f"{kind}_bytes"] = nbytes
  # socket: the full weights' bytes once from process 0 to process 1
  payload = b"".join(np.ascontiguousarray(x).tobytes() for x in jax.tree.leaves(full_host))
  times, cpu = [], []
  for r in range(args.repeats + 1):
    if me == 1:
      with socket.create_server(("127.0.0.1", 0)) as srv:
        client.key_value_set(f"bench/socket/{r}", str(srv.getsockname()[1]))
        conn, _ = srv.accept()
        view, got = memoryview(bytearray(len(payload))), 0
        t, c = time.perf_counter(), time.process_time()
        while got < len(payload):
          got += conn.recv_into(view[got:])
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        conn.sendall(b"k")
        conn.close()
    else:
      port = int(client.blocking_key_value_get(f"bench/socket/{r}", 60_000))
      with socket.create_connection(("127.0.0.1", port)) as conn:
        c = time.process_time()
        conn.sendall(payload)
        conn.recv(1)
        cpu.append(time.process_time() - c)
    client.wait_at_barrier(f"bench/socket/{r}/end", 60_000)
  result["socket_full_cpu_s"] = _both_cpu(client, "socket", me, statistics.median(cpu[1:]))
  if me == 1:
    result["socket_full_s"] = statistics.median(times[1:])
    result["socket_full_bytes_per_s"] = len(payload) / result["socket_full_s"]
  # raw: the same bytes as one array by one cross-host device_put, on 1 device and on 4 per side
  n = len(payload) // 4
  for name, k in (("raw_1dev", 1), ("raw_4dev", 4)):
    shardings = [NamedSharding(Mesh(np.array([d for d in jax.devices() if d.process_index == p][:k]), ("x",)),
                               P("x")) for p in (0, 1)]
    x = (jax.device_put(np.ones((n,), np.float32), shardings[0]) if me == 0
         else jax.make_array_from_single_device_arrays((n,), shardings[0], [], dtype=np.float32))
    # x stays alive: the sender's copy
    s, result[f"{name}_full_cpu_s"] = time_path(name, lambda x: jax.device_put(x, shardings[1]), lambda: x)
    if me == 1:
      result[f"{name}_full_s"], result[f"{name}_full_bytes_per_s"] = s, len(payload) / s
  if me == 1:  # the sampler host's fan-out of the same bytes to its 4 devices: a collective vs copies
    result.update(_fan_out_on_one_host(n, args.repeats))
    from tunixlike.hosts import transfer_server
    result.update(transfer_size=args.transfer_size or transfer_server.TRANSFER_SIZE,
                  connections=args.connections or transfer_server.CONNECTIONS, bucket_bytes=_bucket_bytes(args))
    print("RESULT " + json.dumps(result), flush=True)
  client.wait_at_barrier("bench/end", 300_000)


def _fan_out_on_one_host(n: int, repeats: int) -> dict:
  """A buffer of n float32 split over this process's 4 devices made whole on each of them: the
  all-gather program the sampler host ran until 2026-11-28 (`jit` to a replicated sharding) vs
  `transfer.unpack` (copies and programs of one device, what it runs now). Medians after a warm-up."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from tunixlike.hosts import transfer
  mesh = Mesh(np.array(jax.local_devices()[:4]), ("local",))
  flat = jax.device_put(np.ones((n,), np.float32), NamedSharding(mesh, P("local")))
  whole = NamedSharding(mesh, P())
  gather = jax.jit(lambda x: x, out_shardings=whole)
  copies = lambda x: transfer.unpack([x], (((n,),),), (whole,), mesh)
  out = {}
  for name, run in (("all_gather", gather), ("copies", copies)):
    times = []
    for _ in range(repeats + 1):
      t = time.perf_counter()
      jax.block_until_ready(run(flat))
      times.append(time.perf_counter() - t)
    out[f"fan_out_4dev_{name}_s"] = statistics.median(times[1:])
  return out


def trio_worker(args):
  """Part 2: process 0 learner host, processes 1 and 2 sampler hosts: direct vs relay."""
  import numpy as np
  me, client = _start(args)
  import jax
  from jax.sharding import PartitionSpec as P
  from tunixlike.hosts import layout as layout_lib, transfer
  full_host, _ = _tree(args.mb, args.width, np)
  direct = layout_lib.make_host_layout(2, sampler_tensor=1, learner_tensor=1)
  layouts = {"direct": direct, "relay": dataclasses.replace(direct, senders={1: 0, 2: 1})}
  spec = jax.tree.map(lambda _: P(), full_host)
  src = _learner_copy(full_host, direct, fsdp=True) if me == 0 else None
  result, calls = {}, itertools.count()
  for name, layout in layouts.items():
    times = []
    for r in range(args.repeats + 1):
      tree = (jax.tree.map(lambda x: x + 0, src) if me == 0
              else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), full_host))
      jax.block_until_ready(tree)
      client.wait_at_barrier(f"bench/{name}/{r}", 120_000)
      t = time.perf_counter()
      out = transfer.send_across_hosts(tree, spec, layout=layout, version=next(calls), timeout_s=120,
                                       tag=f"bench/{name}", bucket_bytes=_bucket_bytes(args))[0]
      jax.block_until_ready(out)
      client.key_value_set(f"bench/{name}/{r}/{me}", str(time.perf_counter() - t))
      client.wait_at_barrier(f"bench/{name}/{r}/end", 120_000)
      # until every sampler host has the weights: the slowest of them
      times.append(max(float(client.blocking_key_value_get(f"bench/{name}/{r}/{p}", 60_000)) for p in (1, 2)))
    result[f"fan_out_{name}_s"] = statistics.median(times[1:])
  if me == 1:
    result["fan_out_winner"] = min(layouts, key=lambda name: result[f"fan_out_{name}_s"])
    print("RESULT " + json.dumps(result), flush=True)
  client.wait_at_barrier("bench/end", 60_000)


def rl_worker(args):
  """Part 3: the same RL job in `args.layout` on 2 processes of 4 devices each (4 sampler + 4 learner
  devices in all): `per_host` splits each process 2 + 2, `by_host` makes process 0 a learner host and
  process 1 a sampler host. Each process reports what it measured."""
  from tunixlike import config as config_lib, layouts, workdir as workdir_lib
  by_host = args.layout == "by_host"
  c = config_lib.load(os.path.join(ROOT, "configs", "addition_grpo.py"), "size=tiny")
  c.rewards = ({"fn": "stopped", "weight": 1.0},)  # rewards with variance from the first step: every step trains
  c.warm_start.max_steps = 0
  c.data.num_eval_examples = 8
  c.log.progress_bar = c.log.tensorboard = False
  c.mesh.sampler_devices = c.mesh.learner_devices = 4
  c.mesh.sampler_hosts = 1 if by_host else 0
  c.rl.num_steps = args.rl_steps
  if args.quick:  # a smoke test: one layer, 4 prompts x 4 samples a step in 32 slots, 4 held-out prompts
    c.model.num_layers = 1
    c.rl.prompts_per_step, c.algo.group_size, c.sampler.max_concurrent_decodes = 4, 4, 32
    c.data.num_eval_examples = 4
  cfg = config_lib.from_config_dict(c)
  summary = layouts.run(cfg, args.workdir)
  me, name = int(os.environ["JAX_PROCESS_ID"]), f"rl_{args.layout}"
  if by_host and me == 1:  # the sampler host: its driver's busy fraction at the last weight sync
    result = {f"{name}_sampler_busy_frac": summary["busy_frac"]}
  elif me == 0:
    with open(os.path.join(workdir_lib.local_dir(args.workdir, me), "metrics.jsonl")) as f:
      steps = [r for r in map(json.loads, f) if "learner/step_s" in r]
    times = [r["time_s"] for r in steps]
    last = steps[-1]
    result = {f"{name}_steps": len(steps),
              # after two steps: the first ones compile
              f"{name}_s_per_step": statistics.median(b - a for a, b in zip(times[2:], times[3:])),
              f"{name}_learner_step_s": statistics.median(r["learner/step_s"] for r in steps[2:]),
              f"{name}_sync_ms": statistics.median(r["sync/ms"] for r in steps[2:]),
              f"{name}_learner_busy_frac": last["learner/busy_frac"]}
    if not by_host:  # this host's own sampler (the other host's runs beside it the same way)
      result[f"{name}_sampler_busy_frac"] = last["sampler/busy_frac"]
  else:
    return
  print("RESULT " + json.dumps(result), flush=True)


def _run_job(args, part: str, processes: int, extra: tuple[str, ...] = ()) -> dict:
  """`processes` workers of `part` (with the flags `extra`) as one jax.distributed job on 127.0.0.1;
  every process's RESULT, merged. All are killed when one fails or the time runs out."""
  argv = [sys.executable, os.path.abspath(__file__), "--worker", part, "--mb", str(args.mb),
          "--width", str(args.width), "--repeats", str(args.repeats), "--rl-steps", str(args.rl_steps), *extra,
          *(["--quick"] if args.quick else [])]
  for flag, value in (("--transfer-size", args.transfer_size), ("--connections", args.connections),
                      ("--bucket-mb", args.bucket_mb)):
    if value is not None:
      argv += [flag, str(value)]
  codes, outs = zip(*local_job.run(argv, processes, devices=4, timeout_s=args.timeout, name=part))
  lines = [l for out in outs for l in out.splitlines() if l.startswith("RESULT ")]
  if any(codes) or not lines:
    raise SystemExit(f"benchmark workers ({part}) failed or ran past --timeout {args.timeout:g} s:\n"
                     + "\n".join(o[-3000:] for o in outs))
  return {k: v for l in lines for k, v in json.loads(l[len("RESULT "):]).items()}


def main():
  args = harness.parse(__doc__, _flags)
  if args.quick:
    args.mb, args.width, args.repeats, args.rl_steps = 4.0, 256, 2, 5
  if args.worker is not None:
    return {"pair": pair_worker, "trio": trio_worker, "rl": rl_worker}[args.worker](args)
  if not set(args.parts.split(",")) <= {"1", "2", "3"}:
    print(f"--parts {args.parts}: a comma-separated list of 1, 2, 3", file=sys.stderr)
    raise SystemExit(2)
  parts = {int(p) for p in args.parts.split(",")}
  r = {}
  if 1 in parts:
    r.update(_run_job(args, "pair", 2))
    socket_bw = r["socket_full_bytes_per_s"]
    r["by_host_vs_socket_bandwidth"] = r["by_host_full_bytes_per_s"] / socket_bw
    r["by_host_tp_vs_socket_bandwidth"] = r["by_host_tp_full_bytes_per_s"] / socket_bw
    r["per_host_vs_socket_bandwidth"] = r["per_host_full_bytes_per_s"] / socket_bw
    for name in ("raw_1dev", "raw_4dev"):
      r[f"{name}_vs_socket_bandwidth"] = r[f"{name}_full_bytes_per_s"] / socket_bw
    for name in ("by_host", "by_host_tp", "raw_4dev"):  # CPU seconds of both processes per copy of the weights
      r[f"{name}_vs_socket_cpu"] = r[f"{name}_full_cpu_s"] / r["socket_full_cpu_s"]
    r["by_host_tp_vs_replicated_full_time"] = r["by_host_tp_full_s"] / r["by_host_full_s"]
    r["by_host_vs_per_host_full_time"] = r["by_host_full_s"] / r["per_host_full_s"]
    # LoRA-only against each full sync: the replicated sampler host's and the tensor-parallel one's
    r["by_host_full_vs_lora_time"] = r["by_host_full_s"] / r["by_host_lora_s"]
    r["by_host_tp_full_vs_lora_time"] = r["by_host_tp_full_s"] / r["by_host_lora_s"]
    r["fan_out_4dev_copies_vs_all_gather_time"] = r["fan_out_4dev_copies_s"] / r["fan_out_4dev_all_gather_s"]
  if 2 in parts:
    r.update(_run_job(args, "trio", 3))
  if 3 in parts:
    for layout in ("per_host", "by_host"):
      with tempfile.TemporaryDirectory() as workdir:
        r.update(_run_job(args, "rl", 2, ("--layout", layout, "--workdir", workdir)))
    r["rl_by_host_vs_per_host_step_time"] = r["rl_by_host_s_per_step"] / r["rl_per_host_s_per_step"]
  r.update(parts=sorted(parts), mb=args.mb, width=args.width, repeats=args.repeats, rl_steps=args.rl_steps,
           devices_per_process=4,
           max_process_rss_mb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
  harness.report(r, args)


if __name__ == "__main__":
  main()
