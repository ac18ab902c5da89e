"""The shipped default = the trained pair (configs/k2tiny.py); scripts/decode.py's default --config.

  python scripts/decode.py
  python scripts/decode.py --mode chain --prompt "import os" --max_new_tokens 64
"""

from kdtree_jax import run_config


def get_config():
  return run_config.trained_pair()
