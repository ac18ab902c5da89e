"""Tokenizers: Kimi-style tiktoken (synthetic BPE ranks file), byte tokenizer, auto selection."""

import base64
import importlib.util
import json
import os

import ml_collections
import pytest

from kdtree_jax import loader
from kdtree_jax.tokenizer import ByteTokenizer, TiktokenTokenizer, load_tokenizer

MERGES = [b"he", b"ll", b"llo", b" w", b"hello", b"or", b" wor"]
SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
           "<|im_middle|>"]
TEMPLATE = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}"
            "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant"
            "<|im_middle|>{% endif %}")
N_BASE = 256 + len(MERGES)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_tokenizer(d, template=TEMPLATE):
  """tiktoken.model (256 bytes + a few merges) + tokenizer_config.json in Kimi's layout."""
  os.makedirs(d, exist_ok=True)
  toks = [bytes([i]) for i in range(256)] + MERGES
  with open(os.path.join(d, "tiktoken.model"), "w") as f:
    f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(toks))
  added = {str(N_BASE + i): {"content": s, "special": True} for i, s in enumerate(SPECIAL)}
  conf = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]",
          "tokenizer_class": "TikTokenTokenizer"}
  if template:
    conf["chat_template"] = template
  with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump(conf, f)
  return d


@pytest.fixture(name="tok")
def _tok(tmp_path):
  return TiktokenTokenizer.from_dir(write_tokenizer(str(tmp_path / "kimi")))


def test_merges_and_round_trip(tok):
  assert tok.encode("hello world") == [256 + MERGES.index(b"hello"), 256 + MERGES.index(b" wor"),
                                       ord("l"), ord("d")]
  texts = ["hello world", "def f(x):\n    return x  # ok\n\n", "世界 ünïcode 🙂 it's 123456",
           " " * 30 + "\t\r\n", ""]
  for text in texts:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens(tok):
  ids = {s: N_BASE + i for i, s in enumerate(SPECIAL)}
  assert (tok.bos_id, tok.eos_id) == (ids["[BOS]"], ids["[EOS]"])
  assert tok.encode("hi", bos=True)[0] == tok.bos_id
  assert tok.encode("hi<|im_end|>") == [ord("h"), ord("i"), ids["<|im_end|>"]]
  assert ids["<|im_end|>"] not in tok.encode("<|im_end|>", allow_special=False)
  assert tok.decode([ord("h"), ids["<|im_end|>"]]) == "h<|im_end|>"
  assert tok.decode([ord("h"), ids["<|im_end|>"]], skip_special=True) == "h"
  assert tok.vocab_size == N_BASE + 256  # 256 reserved special ids, unnamed ones placeholders


def test_chat_template(tok):
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
  if importlib.util.find_spec("jinja2") is None:
    with pytest.raises(ImportError, match="pip install jinja2"):
      tok.apply_chat_template(msgs)
    return
  text = tok.apply_chat_template(msgs)
  assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>"
                  "hello<|im_end|><|im_assistant|>assistant<|im_middle|>")
  assert tok.apply_chat_template(msgs, tokenize=True).count(tok.special["<|im_end|>"]) == 2


def test_no_template_and_bad_files(tmp_path):
  tok = TiktokenTokenizer.from_dir(write_tokenizer(str(tmp_path / "a"), template=None))
  with pytest.raises(ValueError, match="no chat_template"):
    tok.apply_chat_template([{"role": "user", "content": "x"}])
  d = write_tokenizer(str(tmp_path / "b"))
  with open(os.path.join(d, "tiktoken.model"), "a") as f:
    f.write("not-a-rank-line\n")
  with pytest.raises(ValueError, match="BASE64_TOKEN RANK"):
    TiktokenTokenizer.from_dir(d)
  with pytest.raises(FileNotFoundError, match="tiktoken.model"):
    TiktokenTokenizer.from_dir(str(tmp_path))


def test_load_tokenizer_picks(tmp_path):
  assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
  assert isinstance(load_tokenizer(write_tokenizer(str(tmp_path / "kimi"))), TiktokenTokenizer)
  for vocab, ok in ((264, True), (1000, False)):
    d = tmp_path / f"v{vocab}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    if ok:
      assert isinstance(load_tokenizer(str(d)), ByteTokenizer)
    else:
      with pytest.raises(ValueError, match="no tokenizer found"):
        load_tokenizer(str(d))
  with pytest.raises(FileNotFoundError):
    load_tokenizer(str(tmp_path / "missing"))


def test_models_tokenizer_field(tmp_path):
  tiny = ml_collections.ConfigDict(dict(checkpoint="", preset="tiny"))
  assert isinstance(loader.make_tokenizer("auto", tiny), ByteTokenizer)
  assert loader.make_tokenizer("none", tiny) is None
  kimi = ml_collections.ConfigDict(dict(checkpoint=write_tokenizer(str(tmp_path / "k")), preset=""))
  assert isinstance(loader.make_tokenizer("auto", kimi), TiktokenTokenizer)
  assert isinstance(loader.make_tokenizer("tiktoken", kimi), TiktokenTokenizer)
  k26 = ml_collections.ConfigDict(dict(checkpoint="", preset="kimi_k2_6"))
  with pytest.raises(ValueError, match="tiktoken.model"):
    loader.make_tokenizer("auto", k26)
  with pytest.raises(ValueError, match="must be one of"):
    loader.make_tokenizer("sentencepiece", tiny)


def _config(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", name + ".py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def test_shipped_configs_tokenizer():
  for name in ("k2tiny",):
    c = _config(name)
    assert c.tokenizer == "auto"
    assert isinstance(load_tokenizer(os.path.join(ROOT, c.target.checkpoint)), ByteTokenizer)
