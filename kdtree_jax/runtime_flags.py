"""Importing this module from a script adds --compile_cache_dir / --command_buffers and applies
them before `main` (`runtime.define_flags`): the one line a script needs for the runtime setup."""

from kdtree_jax import runtime

runtime.define_flags()
