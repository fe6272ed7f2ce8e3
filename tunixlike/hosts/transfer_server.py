"""This process's end of JAX's cross-host transfers (the DCN transfer server): flags set before the
backend starts. A leaf module, so that `distributed.initialize` can start it without importing the
weight-sync machinery of `hosts.transfer`.

JAX's transfer server (XLA's `PjRtTransferServer`) listens on `jax_cross_host_transfer_socket_address`
for control messages and moves the bytes over `jax_cross_host_transport_addresses`: one TCP
connection per address, used in parallel, each with its own send and receive thread; each buffer
goes in chunks of `jax_cross_host_transfer_transfer_size` bytes. The peer connects to the address
each listener reports, so an address must be one the other hosts can reach: JAX's default
(four times 0.0.0.0:0) reports 0.0.0.0, which a peer on another machine cannot reach (XLA
`socket_bulk_transport.cc` sends the listener's own address). `enable` therefore binds them all to
this machine's address towards the coordinator.
"""

import socket

import jax

SOCKET_FLAG = "jax_cross_host_transfer_socket_address"
TRANSPORT_FLAG = "jax_cross_host_transport_addresses"
CHUNK_FLAG = "jax_cross_host_transfer_transfer_size"
TRANSFER_SIZE = 256 * 2**20  # JAX's default chunk
CONNECTIONS = 4  # JAX's default number of data connections


def local_address_towards(host: str) -> str:
  """This machine's IP on the route to `host` (a UDP connect sends nothing)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect((host, 9))
      return s.getsockname()[0]
    except OSError:
      return socket.gethostbyname(socket.gethostname())


def address(coordinator_address: str, process_id: int, port: int | None = None) -> str:
  """This process's transfer server address: this machine's address towards the coordinator, port
  `port` + process_id (default: the coordinator's port + 1 + process_id)."""
  host, coordinator_port = coordinator_address.rsplit(":", 1)
  base = int(coordinator_port) + 1 if port is None else port
  return f"{local_address_towards(host.strip('[]'))}:{base + process_id}"


def enabled() -> bool:
  """Whether this process's transfer server address is set (`enable` ran)."""
  return bool(jax.config.read(SOCKET_FLAG))


def enable(coordinator_address: str, process_id: int, port: int | None = None, *, timeout_s: int,
           transfer_size: int | None = None, connections: int | None = None) -> str:
  """Starts this process's transfer server with its backend: call before anything touches JAX's
  devices. Listens on `port` + process_id (default: the coordinator's port + 1 + process_id), so
  that several processes on one machine never collide; moves the bytes over `connections` TCP
  connections from this machine's address (ports chosen by the system) in chunks of
  `transfer_size` bytes. Returns the address."""
  where = address(coordinator_address, process_id, port)
  ip = where.rsplit(":", 1)[0]
  jax.config.update(SOCKET_FLAG, where)
  jax.config.update(TRANSPORT_FLAG, ",".join([f"{ip}:0"] * (connections or CONNECTIONS)))
  jax.config.update(CHUNK_FLAG, int(transfer_size or TRANSFER_SIZE))
  jax.config.update("jax_cross_host_transfer_timeout_seconds", int(timeout_s))
  return where
