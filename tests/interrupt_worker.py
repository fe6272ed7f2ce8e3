"""A process with the trainer's kind of live threads and its Ctrl-C handling, for test_interrupt.py.

JAX computations run on the main thread (the learner) and on a second thread (the sampler) while a
thread pool waits (the reward workers); SIGINT goes to `Preemption` with the CLI's second-Ctrl-C
exit (`tunixlike.train.interrupted`, for the workdir given as the first argument). Prints "ready"
once everything runs. With `--raise` the second Ctrl-C raises KeyboardInterrupt through the run and
the process exits with sys.exit(130), the way the CLI used to.
"""

import concurrent.futures
import functools
import importlib
import sys
import threading
import time

import jax
import jax.numpy as jnp

from tunixlike.rl.preemption import Preemption

train_cli = importlib.import_module("tunixlike.train")
step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
x = jnp.ones((32, 32))


def sampler():
  while True:  # small steps with short pauses: several of these processes share the test's cores
    step(x).block_until_ready()
    time.sleep(0.002)


def main():
  threading.Thread(target=sampler, name="sampler", daemon=True).start()
  pool = concurrent.futures.ThreadPoolExecutor(4)
  pool.submit(threading.Event().wait)
  workdir = next((a for a in sys.argv[1:] if not a.startswith("--")), None)
  on_second = None if "--raise" in sys.argv else functools.partial(train_cli.interrupted, workdir=workdir)
  try:
    with Preemption(say=lambda m: print(m, flush=True), on_second=on_second):
      step(x).block_until_ready()
      print("ready", flush=True)
      while True:  # the learner's steps go on after the first Ctrl-C, as the run's do until it saves
        step(x).block_until_ready()
        time.sleep(0.002)
  except KeyboardInterrupt:
    sys.exit(130)


if __name__ == "__main__":
  main()
