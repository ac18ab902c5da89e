"""'field=value' settings of a frozen config dataclass (benchmark variant strings such as the MoE
layer bench's "sorted+router_impl=pallas" or probe_xla_options' "packed+lean_glue=false")."""

import dataclasses


def with_overrides(base, items, where: str):
  """base with each 'field=value' of items set, the value parsed by the field's annotated type
  (bool: true/false/1/0, int, float, str; 'none' where the type allows None). An unknown field,
  a value that does not parse or one the config refuses is a ValueError naming `where`."""
  types = {f.name: str(f.type) for f in dataclasses.fields(base)}
  changes = {}
  for item in items:
    field, eq, text = item.partition("=")
    if not eq or field not in types:
      raise ValueError(f"{where}: {item!r} is not field=value with a {type(base).__name__} "
                       f"field (one of {sorted(types)})")
    changes[field] = _parse(where, field, types[field], text)
  try:
    return dataclasses.replace(base, **changes)
  except (ValueError, TypeError) as ex:
    raise ValueError(f"{where}: {ex}") from ex


def _parse(where, field, type_name, text):
  """text as a value of a field annotated type_name ('bool', 'int | None', 'float', 'str')."""
  if "None" in type_name and text.lower() == "none":
    return None
  try:
    if "bool" in type_name:
      return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
    if "int" in type_name:
      return int(text)
    if "float" in type_name:
      return float(text)
  except (KeyError, ValueError) as ex:
    raise ValueError(f"{where}: {field}={text!r} is not a {type_name}") from ex
  if "str" in type_name:
    return text
  raise ValueError(f"{where}: {field} ({type_name}) cannot be set here")
