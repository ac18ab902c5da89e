"""Decoding: sampling, the speculative step (draft -> tree -> verify -> accept -> commit), the loop."""
