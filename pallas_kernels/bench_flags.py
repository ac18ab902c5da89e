"""absl flags the kernel benchmarks share (defined once here: two benches defining the same flag
name cannot be imported into one process, e.g. the test suite, which imports both)."""

from absl import flags

REPS = flags.DEFINE_integer("reps", 20, "CUPTI repetitions per timing (the median is reported).")
