"""Few-row dense dots (M <= 16) over out-major weights as one Pallas Triton kernel (issue 13)."""

from pallas_kernels.skinny_dot.kernel import skinny_dot, supports
from pallas_kernels.skinny_dot.tuning import Tuning, default_tuning

__all__ = ["skinny_dot", "supports", "Tuning", "default_tuning"]
