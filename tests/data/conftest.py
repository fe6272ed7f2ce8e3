import pytest

from tunixlike.data import char_tokenizer, tasks

GSM8K_DIR = tasks.GSM8K_DIR  # shipped with the package


@pytest.fixture(scope="module")
def char_tok():
  return char_tokenizer.build()


@pytest.fixture(scope="session")
def gsm8k_dir():
  return GSM8K_DIR
