"""This process's end of JAX's cross-host transfers (the DCN transfer server): one flag set before
the backend starts. A leaf module, so that `distributed.initialize` can start it without importing
the weight-sync machinery of `hosts.transfer`."""

import socket

import jax

SOCKET_FLAG = "jax_cross_host_transfer_socket_address"


def local_address_towards(host: str) -> str:
  """This machine's IP on the route to `host` (a UDP connect sends nothing)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect((host, 9))
      return s.getsockname()[0]
    except OSError:
      return socket.gethostbyname(socket.gethostname())


def enable(coordinator_address: str, process_id: int, port: int | None = None, timeout_s: int = 60) -> str:
  """Starts this process's transfer server with its backend: call before anything touches JAX's
  devices. Listens on `port` + process_id (default: the coordinator's port + 1 + process_id), so
  that several processes on one machine never collide. Returns the address."""
  host, coordinator_port = coordinator_address.rsplit(":", 1)
  base = int(coordinator_port) + 1 if port is None else port
  address = f"{local_address_towards(host)}:{base + process_id}"
  jax.config.update(SOCKET_FLAG, address)
  jax.config.update("jax_cross_host_transfer_timeout_seconds", int(timeout_s))
  return address
