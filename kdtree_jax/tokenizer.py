"""Tokenizers: byte-level for the small models, Kimi's tiktoken BPE for K2 / K2.5 / K2.6."""

import base64
import json
import os

BYTE_VOCAB = 256
BOS, EOS, PAD, MASK = 256, 257, 258, 259
NUM_SPECIAL = 8  # ids 256..263; vocab_size 264 for the byte models
BYTES_VOCAB_SIZE = BYTE_VOCAB + NUM_SPECIAL

# Kimi K2's pre-tokenisation pattern (tokenization_kimi.py, moonshotai/Kimi-K2-*).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL = 256  # special ids [n_base, n_base + 256); unnamed ones are placeholders
MAX_ENCODE_CHARS = 400_000  # tiktoken panics on longer inputs
MAX_RUN_CHARS = 25_000      # ... and on longer runs of (non-)whitespace


class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; 256 BOS, 257 EOS, 258 PAD, 259 MASK (the DFlash mask token)."""

  vocab_size = BYTES_VOCAB_SIZE
  bos_id, eos_id, pad_id, mask_id = BOS, EOS, PAD, MASK

  def encode(self, text: str, bos: bool = True) -> list[int]:
    return ([BOS] if bos else []) + list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


def load_bpe_ranks(path: str) -> dict[bytes, int]:
  """A tiktoken BPE ranks file (`base64(token) rank` per line) -> {token bytes: rank}."""
  ranks = {}
  with open(path, "rb") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      parts = line.split()
      if len(parts) != 2 or not parts[1].isdigit():
        raise ValueError(f"{path}:{n}: expected 'BASE64_TOKEN RANK', got {line[:80]!r}")
      ranks[base64.b64decode(parts[0])] = int(parts[1])
  if not ranks:
    raise ValueError(f"{path}: empty BPE ranks file")
  return ranks


def _content(tok) -> str | None:
  """A tokenizer_config.json token entry: a string or {"content": ...}."""
  return tok.get("content") if isinstance(tok, dict) else tok


def _split_runs(s: str):
  """Pieces of `s` with no run of whitespace / non-whitespace longer than MAX_RUN_CHARS."""
  start, run, space = 0, 0, s[:1].isspace()
  for i, ch in enumerate(s):
    if ch.isspace() != space:
      run, space = 1, ch.isspace()
    else:
      run += 1
      if run > MAX_RUN_CHARS:
        yield s[start:i]
        start, run = i, 1
  yield s[start:]


class TiktokenTokenizer:
  """Kimi's tokenizer: tiktoken BPE (`tiktoken.model`) + tokenizer_config.json special tokens."""

  def __init__(self, ranks: dict[bytes, int], special: dict[str, int], bos_token="[BOS]",
               eos_token="[EOS]", pad_token=None, chat_template=None, name="tiktoken"):
    import tiktoken  # pylint: disable=import-outside-toplevel
    self.model = tiktoken.Encoding(name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                   special_tokens=special)
    self.special = dict(special)
    self.special_ids = frozenset(special.values())
    self.vocab_size = self.model.n_vocab
    self.bos_id = self._special_id(bos_token, "bos_token")
    self.eos_id = self._special_id(eos_token, "eos_token")
    self.pad_id = self.special.get(pad_token)
    self.chat_template = chat_template

  def _special_id(self, token, field):
    if token not in self.special:
      known = sorted(k for k in self.special if not k.startswith("<|reserved"))
      raise ValueError(f"tokenizer_config.json {field} {token!r} is not a special token; "
                       f"known: {known}")
    return self.special[token]

  @classmethod
  def from_dir(cls, path: str) -> "TiktokenTokenizer":
    """`tiktoken.model` + `tokenizer_config.json` of a Kimi checkpoint directory."""
    model = os.path.join(path, "tiktoken.model")
    if not os.path.isfile(model):
      raise FileNotFoundError(f"{path!r} has no tiktoken.model (Kimi's BPE ranks file)")
    ranks = load_bpe_ranks(model)
    conf = _read_json(os.path.join(path, "tokenizer_config.json"))
    named = {int(i): _content(t) for i, t in conf.get("added_tokens_decoder", {}).items()}
    n = len(ranks)
    ids = range(n, max([n + NUM_RESERVED_SPECIAL] + [i + 1 for i in named]))
    special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
    return cls(ranks, special, bos_token=_content(conf.get("bos_token")) or "[BOS]",
               eos_token=_content(conf.get("eos_token")) or "[EOS]",
               pad_token=_content(conf.get("pad_token")),
               chat_template=conf.get("chat_template") or _read_template(path),
               name=os.path.basename(os.path.normpath(path)) or "tiktoken")

  def encode(self, text: str, bos: bool = False, allow_special: bool = True) -> list[int]:
    """Token ids of `text`; special-token text ('<|im_end|>') maps to its id if allowed."""
    kw = {"allowed_special": "all"} if allow_special else {"disallowed_special": ()}
    ids = [self.bos_id] if bos else []
    for i in range(0, len(text), MAX_ENCODE_CHARS):
      for piece in _split_runs(text[i:i + MAX_ENCODE_CHARS]):
        ids.extend(self.model.encode(piece, **kw))
    return ids

  def decode(self, ids, skip_special: bool = False) -> str:
    ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]  # model vocab may be padded
    if skip_special:
      ids = [i for i in ids if i not in self.special_ids]
    return self.model.decode(ids)

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
    """Renders the checkpoint's Jinja chat template (needs `pip install jinja2`)."""
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat_template (tokenizer_config.json / "
                       "chat_template.jinja); format the prompt yourself")
    try:
      import jinja2  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("apply_chat_template needs jinja2: pip install jinja2") from e
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson  # as HF renders it (no HTML escaping)
    env.globals["raise_exception"] = _raise
    text = env.from_string(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **kw)
    return self.encode(text) if tokenize else text


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _raise(message):
  raise ValueError(f"chat template: {message}")


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _read_template(path: str) -> str | None:
  fname = os.path.join(path, "chat_template.jinja")
  if not os.path.isfile(fname):
    return None
  with open(fname) as f:
    return f.read()


def _config_vocab(path: str) -> int | None:
  """vocab_size from config.json, or from a kdtree_jax orbax marker's config."""
  conf = _read_json(os.path.join(path, "config.json"))
  if not conf:
    conf = _read_json(os.path.join(path, "kdtree_jax_orbax.json")).get("config") or {}
  conf = conf.get("text_config", conf)
  return conf.get("vocab_size")


def load_tokenizer(name_or_dir: str):
  """'bytes' | a checkpoint dir: tiktoken.model -> TiktokenTokenizer, vocab 264 -> bytes."""
  if name_or_dir == "bytes":
    return ByteTokenizer()
  if not name_or_dir or not os.path.isdir(name_or_dir):
    raise FileNotFoundError(f"tokenizer: {name_or_dir!r} is neither 'bytes' nor a directory")
  if os.path.isfile(os.path.join(name_or_dir, "tiktoken.model")):
    return TiktokenTokenizer.from_dir(name_or_dir)
  vocab = _config_vocab(name_or_dir)
  if vocab == BYTES_VOCAB_SIZE:
    return ByteTokenizer()
  raise ValueError(f"no tokenizer found in {name_or_dir!r}: no tiktoken.model and vocab_size "
                   f"{vocab} is not the byte models' {BYTES_VOCAB_SIZE}; copy the tokenizer files "
                   "(tiktoken.model, tokenizer_config.json) there or set config.tokenizer")
