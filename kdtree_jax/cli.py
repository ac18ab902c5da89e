"""The one error, exit and logging convention of every script in scripts/.

  _CONFIG = cli.define_config(DEFAULT_CONFIG, "Run config (configs/*.py).")
  ...
  if __name__ == "__main__":
    cli.run(main)

A mistake ends the run with one line on stderr, `error: <flag, field or file>: <what was wrong>;
<what is allowed>`, and exit status 2 (`UsageError`: a flag, the config file or a config field)
or 1 (`DataError`: a file, a checkpoint, a run the machine cannot hold; and any other failure).
The traceback is printed only with --verbose. absl / jax / orbax INFO logs are quiet unless
--verbose. `progress` prints what is loading or compiling, with elapsed seconds.
"""

import contextlib
import importlib.util
import logging
import os
import re
import sys
import threading
import time
import traceback

from absl import app, flags
from absl import logging as absl_logging

from kdtree_jax import sharding

EXIT_DATA, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
_VERBOSE = flags.DEFINE_bool("verbose", False, "Print tracebacks and INFO logs (absl, jax, orbax).")
_QUIET_LOGGERS = ("jax", "orbax", "absl", "etils", "tensorstore")
_DEFINE_ERRORS: list = []  # errors raised while defining the config flag (its overrides parse then)
_CONFIG_DEFAULT: list = []  # the config flag's default file


class UsageError(ValueError):
  """A flag, config file or config field is wrong. `field`: the config field (or flag) name."""

  def __init__(self, field: str | None, problem: str):
    self.field, self.problem = field, problem
    super().__init__(f"{field}: {problem}" if field else problem)


class DataError(ValueError):
  """A file, checkpoint or size is wrong. `path`: the file or directory (or what was too big)."""

  def __init__(self, path: str, problem: str):
    self.path, self.problem = path, problem
    super().__init__(f"{path}: {problem}")


def flag_name(field: str) -> str:
  """The command-line spelling of a config field: its own flag if the user gave that flag."""
  if field.startswith("-"):
    return field
  if field in flags.FLAGS and field != "config" and flags.FLAGS[field].present:
    return f"--{field}"  # the user gave the flag
  return f"--config.{field}"


def error_line(exc: BaseException) -> tuple[int, str]:
  """(exit status, the one `error: ...` line) for any exception."""
  if isinstance(exc, UsageError):
    where = f"{flag_name(exc.field)}: " if exc.field else ""
    return EXIT_USAGE, f"error: {where}{exc.problem}"
  if isinstance(exc, DataError):
    return EXIT_DATA, f"error: {exc}"
  if isinstance(exc, app.UsageError):  # absl's: the scripts' messages name their flags
    return EXIT_USAGE, f"error: {' '.join(str(exc).split())}"
  text = " ".join(str(exc).split()) or type(exc).__name__
  if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text:
    return EXIT_DATA, (f"error: out of device memory ({text[:200]}); lower --config.budget, "
                       "--config.max_len or --config.max_new_tokens, or shard with "
                       "--config.mesh")
  if isinstance(exc, (OSError, ValueError, KeyError)):
    return EXIT_DATA, f"error: {text}"
  return EXIT_DATA, f"error: {type(exc).__name__}: {text} (a bug? rerun with --verbose)"


def _verbose(argv) -> bool:
  if _VERBOSE.present:
    return _VERBOSE.value
  return any(a in ("--verbose", "--verbose=true", "--verbose=1") for a in argv or sys.argv)


def fail(exc: BaseException, argv=None):
  """Prints the traceback (with --verbose only), then the error line; exits."""
  if _verbose(argv):
    traceback.print_exception(exc)
  code, line = error_line(exc)
  sys.stdout.flush()
  print(line, file=sys.stderr, flush=True)
  sys.exit(code)


def quiet_logs(verbose: bool):
  """absl / jax / orbax at WARNING unless verbose (the 'tpu' line, orbax's INFO chatter)."""
  level = logging.INFO if verbose else logging.WARNING
  for name in _QUIET_LOGGERS:
    logging.getLogger(name).setLevel(level)
  # orbax's reader tasks log their tracebacks through asyncio; the error line says it all
  logging.getLogger("asyncio").setLevel(logging.INFO if verbose else logging.CRITICAL)
  absl_logging.set_verbosity(absl_logging.INFO if verbose else absl_logging.WARNING)


def define_config(default: str | None, help_text: str):
  """DEFINE_config_file('config'); an override of a missing field fails in `run`, not here."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  _CONFIG_DEFAULT.append(default)
  try:
    return config_flags.DEFINE_config_file("config", default, help_text)
  except Exception as e:  # pylint: disable=broad-except
    _DEFINE_ERRORS.append(_override_error(e, default))
    return None


def _argv_config_path(argv, default):
  """The --config file named on the command line (without its ':arg'), else the default."""
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      return a.split("=", 1)[1].split(":", 1)[0]
    if a == "--config" and i + 1 < len(argv):
      return argv[i + 1].split(":", 1)[0]
  return default


def overridden(field: str) -> bool:
  """Whether the command line sets `--config.<field>` (e.g. 'budget', 'target.checkpoint')."""
  name = f"--config.{field}"
  return any(a == name or a.startswith(name + "=") for a in sys.argv[1:])


def dotted_fields(cfg, prefix="") -> list[str]:
  """Every leaf field of a ConfigDict as 'a.b' paths."""
  out = []
  for key, value in cfg.items():
    if hasattr(value, "items"):
      out += dotted_fields(value, f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


def load_config_file(path: str):
  """get_config() of a configs/*.py file ('file.py:arg' passes arg)."""
  file, *arg = path.split(":", 1)
  spec = importlib.util.spec_from_file_location("_cli_config", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*arg)


def _fields_under(fields: list[str], parent: str) -> list[str]:
  """The fields below `parent` ('' = the top), a section shown once as 'name.*'."""
  out = set()
  for f in fields:
    if f.startswith(parent):
      rest = f[len(parent):]
      out.add(parent + (rest.split(".", 1)[0] + ".*" if "." in rest else rest))
  return sorted(out)


def _override_error(exc, default) -> Exception:
  """A `--config.x=v` naming no field of the config file -> UsageError naming that flag."""
  path = _argv_config_path(sys.argv, default)
  path = os.path.relpath(os.path.normpath(path)) if path else path
  try:
    fields = dotted_fields(load_config_file(path))
  except Exception:  # pylint: disable=broad-except
    return UsageError("--config", f"cannot load the config file {path!r}: "
                      f"{' '.join(str(exc).split())[-200:]}")
  known = set(fields) | {f.rsplit(".", 1)[0] for f in fields if "." in f}
  for a in sys.argv[1:]:
    if a.startswith("--config."):
      name = a[len("--config."):].split("=", 1)[0]
      if name not in known:
        parent = name.rsplit(".", 1)[0] + "." if "." in name else ""
        while parent and not any(f.startswith(parent) for f in fields):  # nearest real section
          parent = parent[:-1].rsplit(".", 1)[0] + "." if "." in parent[:-1] else ""
        where = f"fields under {parent[:-1]}" if parent else "fields"
        return UsageError(f"--config.{name}", f"{path} has no field {name!r}; its {where}: "
                          f"{', '.join(_fields_under(fields, parent))}")
  return UsageError("--config", f"{path}: {' '.join(str(exc).split())}")


def load_config(holder, example: str = "configs/tiny.py"):
  """The config a `define_config` flag holds; a missing or unreadable file -> UsageError."""
  if holder.value is None:
    raise UsageError("--config", f"is required: name a config file, e.g. --config {example}")
  try:
    config = holder.value
    config.keys()  # a file that failed to load raises on first use
    return config
  except (OSError, AttributeError) as e:
    path = config_path()
    reason = "no such file" if isinstance(e, FileNotFoundError) or "Errno 2" in str(e) else \
        " ".join(str(e).split())[-200:]
    raise UsageError("--config", f"cannot read the config file {path!r} ({reason}); give a "
                     "configs/*.py file, e.g. --config configs/tiny.py") from e


def config_path() -> str:
  """The file the command line's --config names (without a :preset), for tables kept beside it."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  return config_flags.get_config_filename(flags.FLAGS["config"])


def _config_fields() -> list[str]:
  """The fields of the config file named on the command line (or the default); [] if none."""
  path = _argv_config_path(sys.argv, _CONFIG_DEFAULT[0] if _CONFIG_DEFAULT else None)
  try:
    return dotted_fields(load_config_file(path)) if path else []
  except Exception:  # pylint: disable=broad-except
    return []


def _flag_error(exc: Exception) -> UsageError:
  """absl's flag errors already name the flag; config-file errors keep their last line."""
  text = str(exc)
  if "config file" in text or "get_config" in text:
    last = [ln for ln in text.splitlines() if ln.strip()][-1].strip()
    return UsageError("--config", f"the config file failed to load: {last}")
  unknown = re.search(r"Unknown command line flag '([\w.]+)'", text)
  if unknown and unknown.group(1) in _config_fields():
    name = unknown.group(1)
    return UsageError(None, f"unknown flag --{name}; it is a config field: set it as "
                      f"--config.{name}=VALUE (see --help)")
  return UsageError(None, f"{' '.join(text.split())} (see --help)")


def _parse_flags(argv):
  """absl's flag parsing, with every failure turned into one `error:` line."""
  if _DEFINE_ERRORS:
    fail(_DEFINE_ERRORS[0], argv)
  if any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:]):
    for name in ("config", "verbose"):  # listed with the script's own flags
      if name in flags.FLAGS:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
    app.usage(shorthelp=True, writeto_stdout=True)
    sys.exit(0)
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    fail(_flag_error(e), argv)
  except (KeyError, AttributeError) as e:  # an override naming no field of the config file
    fail(_override_error(e, _CONFIG_DEFAULT[0] if _CONFIG_DEFAULT else None), argv)
  except Exception as e:  # pylint: disable=broad-except  (a config file that does not run)
    fail(UsageError("--config", f"the config file failed to load: {type(e).__name__}: "
                    f"{' '.join(str(e).split())[:300]}"), argv)
  quiet_logs(_VERBOSE.value)
  return rest


def run(main):
  """app.run(main) under the convention: one `error:` line and exit 2 / 1, no traceback."""
  def guarded(argv):
    try:
      if len(argv) > 1:
        raise UsageError(None, f"unexpected argument {argv[1]!r}: every input is a flag "
                         "(e.g. --config.prompt='text')")
      return main(argv)
    except KeyboardInterrupt:
      print("interrupted", file=sys.stderr)
      sys.exit(EXIT_INTERRUPTED)
    except Exception as e:  # pylint: disable=broad-except
      fail(e)
  quiet_logs(_verbose(sys.argv))
  app.run(guarded, flags_parser=_parse_flags)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO_ROOT, "checkpoints")


def refuse_shipped_output(path: str, field: str, allow_flag: str, allowed: bool):
  """UsageError when `path` lies in the repo's checkpoints/ (the shipped models) unless allowed."""
  real = os.path.realpath(path if os.path.isabs(path) else os.path.join(os.getcwd(), path))
  inside = os.path.commonpath([real, os.path.realpath(SHIPPED)]) == os.path.realpath(SHIPPED)
  if inside and not allowed:
    raise UsageError(field, f"{path!r} is inside checkpoints/, which holds the shipped models; "
                     f"write elsewhere (e.g. runs/) or pass {allow_flag} to replace them")


@contextlib.contextmanager
def progress(label: str, every_s: float = 10.0, out=None):
  """Prints `label ...`, then `label ... N s` every `every_s` seconds, then `label: N s`."""
  out = out or sys.stderr
  t0 = time.perf_counter()
  print(f"{label} ...", file=out, flush=True)
  stop = threading.Event()

  def tick():
    while not stop.wait(every_s):
      print(f"{label} ... {time.perf_counter() - t0:.0f} s", file=out, flush=True)

  ticker = threading.Thread(target=tick, daemon=True)
  ticker.start()
  try:
    yield
  finally:
    stop.set()
    ticker.join()
  print(f"{label}: {time.perf_counter() - t0:.1f} s", file=out, flush=True)


def distributed_from_env() -> sharding.Distributed:
  """The multi-process launch as the launcher sets it: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
  and JAX_PROCESS_ID (jax itself reads JAX_LOCAL_DEVICE_IDS). Scripts only: the library takes a
  `sharding.Distributed`."""
  env = os.environ
  n = int(env.get("JAX_NUM_PROCESSES", "1"))
  rank = env.get("JAX_PROCESS_ID")
  if env.get("JAX_COORDINATOR_ADDRESS") and n > 1 and rank is None:
    raise UsageError("JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES are set "
                     "but JAX_PROCESS_ID is not; set it to this host's rank in "
                     "[0, JAX_NUM_PROCESSES)")
  return sharding.Distributed(env.get("JAX_COORDINATOR_ADDRESS"), n,
                              None if rank is None else int(rank))
