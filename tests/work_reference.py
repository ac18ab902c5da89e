"""The work list's numpy reference, shared by the kernel and glue tests."""


def items_brute_force(sizes, rows):
  """(expert, window, lo, size) by walking each expert's rows in windows from its 8-aligned start."""
  out, start = [], 0
  for g, s in enumerate(sizes):
    win = start - start % 8
    while s and win < start + s:
      lo, hi = max(start, win), min(start + s, win + rows)
      out.append([g, win, lo - win, hi - lo])
      win += rows
    start += s
  return out
