"""The seal on messages between hosts and the secret's sources (`hosts.seal`), and the config
fingerprint the hosts compare at start-up (`hosts.rendezvous`): no processes, no JAX."""

import os

import pytest

from tunixlike import config as config_lib
from tunixlike.hosts import rendezvous, seal

KEY = "tunixlike/rollouts/groups/0/1/7"


def test_an_entry_opens_once_under_its_key_run_and_secret():
  writer, reader = seal.Sealer(b"s", b"run", 1), seal.Sealer(b"s", b"run", 0)
  data = writer.seal(KEY, b"group")
  assert reader.open(KEY, data, once=True) == b"group"
  assert reader.open(KEY, data, once=True) is None  # replayed
  assert reader.open(KEY + "0", data, once=True) is None  # moved to another key
  assert seal.Sealer(b"s", b"another run", 0).open(KEY, data, once=True) is None
  assert seal.Sealer(b"another secret", b"run", 0).open(KEY, data, once=True) is None
  tampered = data[:-1] + bytes([data[-1] ^ 1])
  assert reader.open(KEY, tampered, once=True) is None
  assert reader.open(KEY, b"short", once=True) is None
  assert reader.refused == 4  # the other run's and secret's readers counted theirs


def test_an_overwritten_entry_may_be_read_again_but_not_go_back():
  writer, reader = seal.Sealer(b"s", b"run", 2), seal.Sealer(b"s", b"run", 0)
  old, new = writer.seal("alive/2", b"1"), writer.seal("alive/2", b"2")
  assert reader.open("alive/2", new, once=False) == b"2"
  assert reader.open("alive/2", new, once=False) == b"2"
  assert reader.open("alive/2", old, once=False) is None and reader.refused == 1
  # another writer of the same key keeps its own sequence
  assert reader.open("alive/2", seal.Sealer(b"s", b"run", 3).seal("alive/2", b"x"), once=False) == b"x"


def test_the_secret_comes_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
  monkeypatch.delenv(seal.ENV_SECRET, raising=False)
  monkeypatch.delenv(seal.ENV_SECRET_FILE, raising=False)
  with pytest.raises(seal.SecretError, match="whole hosts on several machines need the run's secret: give every "
                                             "host the same TUNIXLIKE_HOSTS_SECRET_FILE=PATH"):
    seal.load("10.0.0.1", 8482, 1)
  path = tmp_path / "secret"
  path.write_text("abc\n")
  os.chmod(path, 0o644)
  monkeypatch.setenv(seal.ENV_SECRET_FILE, str(path))
  with pytest.raises(seal.SecretError, match=f"must be yours and readable by you only \\(chmod 600 {path}\\)"):
    seal.load("10.0.0.1", 8482, 1)
  os.chmod(path, 0o600)
  assert seal.load("10.0.0.1", 8482, 1) == b"abc"
  monkeypatch.setenv(seal.ENV_SECRET, "xyz")  # the value wins over the file
  assert seal.load("10.0.0.1", 8482, 1) == b"xyz"


def test_one_machine_draws_a_secret_per_run(tmp_path, monkeypatch):
  monkeypatch.delenv(seal.ENV_SECRET, raising=False)
  monkeypatch.delenv(seal.ENV_SECRET_FILE, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  assert seal.is_loopback("127.0.0.1") and seal.is_loopback("localhost") and not seal.is_loopback("10.0.0.1")
  first = seal.load("127.0.0.1", 9000, 0)
  assert seal.load("127.0.0.1", 9000, 1) == first  # another process of the same run
  assert os.stat(seal.own_secret_path(9000)).st_mode & 0o777 == 0o600
  assert seal.load("127.0.0.1", 9000, 0) != first  # the next run's process 0 draws a new one


def test_the_fingerprint_covers_every_key_but_logs_and_process_ids():
  base = config_lib.Config()
  same = config_lib.replace(base, log=dict(tensorboard=not base.log.tensorboard), distributed=dict(process_id=3))
  assert rendezvous.differing(rendezvous.fingerprint(base), rendezvous.fingerprint(same)) == []
  other = config_lib.replace(base, seed=1, model=dict(hidden_size=base.model.hidden_size * 2))
  assert rendezvous.differing(rendezvous.fingerprint(base), rendezvous.fingerprint(other)) == [
      "model.hidden_size", "seed"]


def test_the_coordinator_listens_on_the_address_given(monkeypatch):
  from tunixlike import distributed
  monkeypatch.delenv(distributed.ENV_BIND, raising=False)
  cfg = distributed.DistributedConfig(coordinator_address="127.0.0.1:8482")
  assert distributed.bind_address(cfg) == "127.0.0.1:8482"  # not JAX's default, every interface ('[::]:8482')
  assert distributed.bind_address(distributed.DistributedConfig(coordinator_address="[::1]:9")) == "[::1]:9"
  monkeypatch.setenv(distributed.ENV_BIND, "0.0.0.0:8482")
  assert distributed.bind_address(cfg) == "0.0.0.0:8482"
  given = distributed.DistributedConfig(coordinator_address="127.0.0.1:8482", coordinator_bind_address="10.1.2.3:8482")
  assert distributed.bind_address(given) == "10.1.2.3:8482"
  monkeypatch.delenv(distributed.ENV_BIND)
  with pytest.raises(ValueError, match="distributed.coordinator_address=no-such-host.invalid:1: 'no-such-host.invalid' "
                                       "does not resolve on this host"):
    distributed.bind_address(distributed.DistributedConfig(coordinator_address="no-such-host.invalid:1"))
