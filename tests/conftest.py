"""Shared test set-up: 8 virtual CPU devices (4 sampler + 4 learner) before JAX starts."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
