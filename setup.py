"""tunixlike: asynchronous RL post-training for LLMs in JAX (TPU / GPU; CPU for development)."""

import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "README.md")
# The examples that ship inside the package (tunixlike/examples/<name>/: config, data, rewards, agent).
EXAMPLES = sorted(d for d in os.listdir(os.path.join(HERE, "examples"))
                  if os.path.isfile(os.path.join(HERE, "examples", d, "config.py")))

setup(
    name="tunixlike",
    version="0.1.0",
    description="Async GRPO-family RL for LLMs in JAX: sampler and learner submeshes, bounded staleness.",
    # A source tree without the README (a partial copy) still builds.
    long_description=open(README, encoding="utf-8").read() if os.path.isfile(README) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # configs/ and examples/ stay at the top of the repository, where a reader finds them; installed, they
    # are tunixlike/configs/ and tunixlike/examples/, which `--config NAME` finds (tunixlike/shipped_configs.py).
    packages=find_packages(include=["tunixlike", "tunixlike.*"]) + ["tunixlike.configs"]
    + [f"tunixlike.examples.{name}" for name in EXAMPLES],
    package_dir={"tunixlike.configs": "configs", "tunixlike.examples": "examples"},
    package_data={
        "tunixlike.data": ["gsm8k/*.jsonl", "gsm8k/LICENSE"],  # GSM8K (MIT), openai/grade-school-math
        **{f"tunixlike.examples.{name}": ["*.jsonl", "*.md"] for name in EXAMPLES},
    },
    install_requires=[
        # The JAX stack: ranges, so that an existing TPU VM, GPU container or Colab keeps its own JAX.
        # Lower bounds: the oldest versions tested (constraints.txt is the exact tested set); upper
        # bounds: the next release series, whose API changes nobody has run this code against.
        # docs/hosts_and_accelerators.md says which versions ran where.
        "jax>=0.10.2,<0.13",
        "jaxlib>=0.10.2,<0.13",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.4,<0.13",
        "grain>=0.2.18,<0.3",
        "ml-collections>=1.1.0",
        "numpy>=2.0",
        "tokenizers>=0.22",
        "huggingface_hub>=0.30,<3",  # model.hf_path by Hub name: its cache, revisions, offline mode
        "safetensors>=0.6",
        "jinja2>=3.1",  # chat templates
        "pyarrow>=20",
        "tensorboardX>=2.6",
        "matplotlib>=3.9",
        "tqdm>=4.66",
        "starlette>=0.40",  # the agent server (rl.agent): an ASGI app
        "uvicorn>=0.30",  # ... and its server, which uses the two below (C parsers and event loop) when present
        "httptools>=0.6",
        "uvloop>=0.19; sys_platform != 'win32'",
    ],
    extras_require={
        "test": [
            # torch 2.13.0 CPU: a wheel of it lies on the CI machine; a looser pin would pull a CUDA build.
            "torch==2.13.0",
            "transformers>=5.0",
            "datasets>=3.0",  # reading datasets saved with save_to_disk
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.6",  # the README's test command runs two test processes (-n 2)
            "chex>=0.1.90",
            "hypothesis>=6.100",
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6.29",
            "wandb>=0.19",  # log.wandb (optional: imported only when it is on; tested offline)
            "openai>=1.40",  # the agent example and tests talk to the agent server with the official client
            "httpx>=0.27",
        ],
        "jetstream": ["google-jetstream==0.2.2"],
    },
    entry_points={"console_scripts": ["tunixlike-train=tunixlike.train:main"]},
)
