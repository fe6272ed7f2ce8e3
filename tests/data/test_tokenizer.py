import json
import os

import pytest

from tunixlike.data import char_tokenizer, tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Exercises trim_blocks / lstrip_blocks, a special-token variable and tojson like real templates do.
BLOCKY = """{{ bos_token }}
{%- for m in messages %}
  {% if m['role'] == 'system' %}
[SYS]{{ m['content'] | tojson }}
  {% else %}
[{{ m['role'] | upper }}]{{ m['content'] }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""
MESSAGES = [{"role": "system", "content": "Be <brief> & exact."}, {"role": "user", "content": "12+34="}]


def test_char_tokenizer_roundtrip_and_special_ids(char_tok):
  ids = char_tok.encode("123+456=\n ab")
  assert ids[0] == char_tok.bos_id == 1
  assert len(ids) == 1 + len("123+456=\n ab")  # one token per character
  assert char_tok.decode(ids) == "123+456=\n ab"
  assert char_tok.decode(ids + [char_tok.eos_id, char_tok.pad_id]) == "123+456=\n ab"
  assert char_tok.decode([char_tok.eos_id], skip_special_tokens=False) == "<eos>"
  assert (char_tok.pad_id, char_tok.bos_id, char_tok.eos_id) == (0, 1, 2)
  assert char_tok.vocab_size == len(char_tokenizer.SPECIAL_TOKENS) + len(char_tokenizer.DEFAULT_CHARS)
  assert char_tok.encode("a\u00e9", add_special_tokens=False)[1] == char_tok.hf.token_to_id("<unk>")
  assert char_tok.stop_ids == (2,)


def test_save_then_load_gives_same_ids(char_tok, tmp_path):
  char_tok.save(str(tmp_path))
  loaded = tokenizer.load(str(tmp_path))
  text = "reverse abc=cba 99+1=001"
  assert loaded.encode(text) == char_tok.encode(text)
  assert (loaded.eos_id, loaded.pad_id, loaded.bos_id, loaded.vocab_size) == (2, 0, 1, char_tok.vocab_size)
  assert loaded.chat_template is None
  assert loaded.format_prompt("1+2=") == "1+2="
  # Also loadable as a file path.
  assert tokenizer.load(str(tmp_path / "tokenizer.json")).encode(text) == char_tok.encode(text)


def test_transformers_loads_our_tokenizer(char_tok, tmp_path):
  transformers = pytest.importorskip("transformers")
  char_tok.save(str(tmp_path))
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert hf("12+3=")["input_ids"] == char_tok.encode("12+3=")
  assert hf.eos_token_id == char_tok.eos_id


@pytest.mark.parametrize("template", [CHATML, BLOCKY])
def test_chat_template_matches_transformers(tmp_path, template):
  transformers = pytest.importorskip("transformers")
  base = char_tokenizer.build()
  tok = tokenizer.Tokenizer(base.hf, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>", chat_template=template)
  tok.save(str(tmp_path))
  ours = tokenizer.load(str(tmp_path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for add in (True, False):
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add) == expected
  assert ours.format_prompt("12+34=", system="Be <brief> & exact.") == theirs.apply_chat_template(
      MESSAGES, tokenize=False, add_generation_prompt=True)


def test_chat_template_sources(tmp_path):
  base = char_tokenizer.build()
  base.save(str(tmp_path))
  config_path = tmp_path / "tokenizer_config.json"
  config = json.loads(config_path.read_text())
  config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
  config["eos_token"] = {"content": "<eos>", "__type": "AddedToken"}  # Serialized AddedToken form.
  config_path.write_text(json.dumps(config))
  tok = tokenizer.load(str(tmp_path))
  assert tok.format_prompt("x") == "D<eos>"
  (tmp_path / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")  # Takes precedence.
  assert tokenizer.load(str(tmp_path)).format_prompt("x") == "Jx"
  assert tokenizer.load(str(tmp_path)).format_prompt("x", use_chat_template=False) == "x"


def test_generation_config_stop_ids_and_missing_eos(tmp_path):
  base = char_tokenizer.build()
  base.save(str(tmp_path))
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  del config["eos_token"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="no eos_token"):
    tokenizer.load(str(tmp_path))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  tok = tokenizer.load(str(tmp_path))
  assert tok.eos_id == 2 and tok.stop_ids == (2, 0)


def test_bad_inputs(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    tokenizer.load(str(tmp_path))
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer.json"):
    tokenizer.load(str(tmp_path))
  base = char_tokenizer.build()
  with pytest.raises(ValueError, match="eos_token='<nope>'"):
    tokenizer.Tokenizer(base.hf, eos_token="<nope>")
  with pytest.raises(ValueError, match="no chat template"):
    base.apply_chat_template(MESSAGES)
  base.save(str(tmp_path))
  (tmp_path / "tokenizer_config.json").write_bytes(b"\xff\xfe")
  with pytest.raises(ValueError, match="tokenizer_config.json"):
    tokenizer.load(str(tmp_path))
  assert os.path.exists(tmp_path / "tokenizer.json")
