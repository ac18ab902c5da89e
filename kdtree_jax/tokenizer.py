"""Tokenizers: a byte-level one for the small models (Kimi's tiktoken tokenizer: issue 6)."""

BYTE_VOCAB = 256
BOS, EOS, PAD, MASK = 256, 257, 258, 259
NUM_SPECIAL = 8  # ids 256..263; vocab_size 264 for the byte models


class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; 256 BOS, 257 EOS, 258 PAD, 259 MASK (the DFlash mask token)."""

  vocab_size = BYTE_VOCAB + NUM_SPECIAL
  bos_id, eos_id, pad_id, mask_id = BOS, EOS, PAD, MASK

  def encode(self, text: str, bos: bool = True) -> list[int]:
    return ([BOS] if bos else []) + list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")
