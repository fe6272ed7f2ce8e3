"""Whole hosts for the sampler, whole hosts for the learner (mesh.sampler_hosts > 0).

`layout` decides which processes decode and which train and builds their meshes; `transfer` moves
the learner's weights to the sampler hosts by cross-host `jax.device_put`; `kv` is the small
messages (acknowledgements, rollouts' metadata) through the `jax.distributed` coordination
service's key-value store, each sealed under the run's secret (`seal`). The one socket of its own
is the start-up rendezvous (`rendezvous`: every process there, the same config, free ports, the
secret), before JAX's service takes the coordinator's port; `watch` turns the loss of that service
into one line.
"""
