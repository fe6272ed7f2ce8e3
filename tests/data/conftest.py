import pytest

from tunixlike.data import char_tokenizer

GSM8K_DIR = "/work/shared/data/gsm8k"


@pytest.fixture(scope="module")
def char_tok():
  return char_tokenizer.build()


@pytest.fixture(scope="session")
def gsm8k_dir():
  return GSM8K_DIR
