"""A character-level tokenizer for the synthetic tasks, built as a real `tokenizers.Tokenizer`.

One token per character (WordLevel over single characters) keeps the vocabulary tiny (< 128) so
test models stay small, and it is a genuine tokenizer.json: `save` then `tokenizer.load` gives
the same ids, exactly like a Hugging Face model directory.
"""

from __future__ import annotations

import string

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from tunixlike.data.tokenizer import Tokenizer

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3
DEFAULT_CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=().,:?!#$%\n"


def build(chars: str = DEFAULT_CHARS) -> Tokenizer:
  """Returns a char tokenizer: <pad>=0 <bos>=1 <eos>=2 <unk>=3, then one id per char of `chars`.

  Encoding with special tokens prepends <bos>; the model learns to emit <eos> itself.
  """
  if len(set(chars)) != len(chars):
    raise ValueError(f"chars has duplicate characters: {chars!r}")
  vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
  for c in chars:
    vocab[c] = len(vocab)
  hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  # Every character (newline included) becomes its own pre-token.
  hf.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  hf.decoder = decoders.Fuse()  # Concatenate, no spaces between tokens.
  hf.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                    special_tokens=[("<bos>", 1)])
  hf.add_special_tokens(list(SPECIAL_TOKENS))
  return Tokenizer(hf, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>", unk_token="<unk>")
