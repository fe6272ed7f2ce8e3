"""What a user starts from: the repository's files as a clone holds them, and a Python environment
without tunixlike.

`fresh_venv` makes a virtual environment that sees the packages of the interpreter running the tests
(jax, flax, ipykernel ...; a `.pth` file lists their directories) but not tunixlike, however it is
installed here (editable, or on PYTHONPATH): the `.pth` of an editable install is not read, because
directories a `.pth` file adds are not site directories. So `import tunixlike` there finds only what
is installed into the environment itself. `install_env` is the environment its commands run with:
no PYTHONPATH, and pip with neither an index nor build isolation (the build uses the setuptools
already here), so an install fetches nothing.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def source_copy(dest: pathlib.Path) -> pathlib.Path:
  """The checkout's tracked and untracked-but-not-ignored files as they are now, copied to `dest`."""
  try:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("needs a git checkout of the repository (to know which files a clone holds)")
  for name in filter(None, listed):
    if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not there
      (dest / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(ROOT / name, dest / name)
  return dest


def git_repository(dest: pathlib.Path) -> str:
  """A git repository of `source_copy` at `dest` (one commit), as a URL that pip's `git+` takes."""
  source_copy(dest)
  git = ["git", "-c", "user.name=tests", "-c", "user.email=tests@localhost", "-c", "init.defaultBranch=main"]
  for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the working tree"]):
    subprocess.run(git + args, cwd=dest, check=True, capture_output=True)
  return dest.as_uri()


def fresh_venv(path: pathlib.Path) -> pathlib.Path:
  """A virtual environment at `path` with this interpreter's packages but no tunixlike; its python."""
  venv.EnvBuilder(with_pip=False).create(path)  # pip comes from this interpreter's packages
  python = path / "bin" / "python"
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        capture_output=True, text=True, check=True, env=install_env()).stdout.strip()
  outer = [p for p in sys.path if p and os.path.isdir(p) and not pathlib.Path(p).resolve().is_relative_to(ROOT)
           and not os.path.isfile(os.path.join(p, "tunixlike", "__init__.py"))]
  pathlib.Path(site, "outer_packages.pth").write_text("\n".join(outer) + "\n")
  return python


def install_env(**extra: str) -> dict[str, str]:
  """The environment of commands in a fresh venv: no PYTHONPATH, and an offline pip without build isolation."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
             PIP_NO_BUILD_ISOLATION="0")  # pip reads this variable backwards: "0" turns isolation off
  env.update(extra)
  return env
