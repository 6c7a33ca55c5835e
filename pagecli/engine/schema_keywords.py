"""JSON Schema keywords the grammar engine would accept and then not enforce: refused by name, never ignored.

xgrammar (0.2.x) compiles these without a word, yet lets output through that breaks them (measured: a
violating instance is accepted). A request whose schema uses one gets a RequestError naming the keyword
and where it is, so its output is never said to follow a schema it does not follow. `oneOf` is enforced
as `anyOf` (a value valid for more than one branch passes); that is the common case of unions whose
branches exclude each other (tagged by a `const` field), so it is accepted.
"""

from __future__ import annotations

from typing import Any

from pagecli.engine.grammar_limits import refuse_large_count, regex_problem
from pagecli.errors import RequestError

_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
               "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
# The `format` values whose strings xgrammar constrains; any other would be an annotation only.
_ENFORCED_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6",
                               "uri", "uri-reference", "uuid"})
# Keywords whose value is a map of name -> subschema, or a list of subschemas: where to look deeper.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")


def refuse_unenforced_keywords(schema: Any, where: str = "#") -> None:
    """Raise RequestError at the first keyword, anywhere in schema, that would not be enforced."""
    if not isinstance(schema, dict):
        return
    refuse_large_count(schema, where)
    problem = _node_problem(schema)
    if problem is not None:
        raise RequestError(f"the JSON schema uses {problem} at {where}, which constrained decoding cannot "
                           "enforce; remove it or check it after generation.")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                refuse_unenforced_keywords(sub, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                refuse_unenforced_keywords(sub, f"{where}/{key}/{i}")
    for key in _SCHEMA_VALUES:
        refuse_unenforced_keywords(schema.get(key), f"{where}/{key}")


def _node_problem(schema: dict[str, Any]) -> str | None:
    """The unenforced keyword of one schema node (not its subschemas), as the message names it."""
    for key in _UNENFORCED:
        if key in schema:
            return f"'{key}'"
    if schema.get("uniqueItems") is True:
        return "'uniqueItems'"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "'allOf' with more than one schema"
    if "multipleOf" in schema:
        problem = _multiple_of_problem(schema)
        if problem is not None:
            return problem
    form = schema.get("format")
    if isinstance(form, str) and form not in _ENFORCED_FORMATS:
        return f"format '{form}'"
    lengths = [key for key in ("minLength", "maxLength") if key in schema]
    for rule in ("pattern", "format"):
        if rule in schema and lengths:
            return f"'{lengths[0]}' together with '{rule}' (the engine keeps the {rule} and drops the length)"
    if isinstance(schema.get("pattern"), str):
        problem = regex_problem(schema["pattern"])
        if problem is not None:
            return f"{problem} of 'pattern' {schema['pattern']!r}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"'$ref' to {ref!r} (only '#' and '#/...' references within the schema are followed)"
    return None


def schema_regexes(schema: Any) -> list[str]:
    """Every regular expression in schema: its `pattern` values and `patternProperties` names, at any depth."""
    found: list[str] = []
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found.extend(str(name) for name in node["patternProperties"])
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return found


def _multiple_of_problem(schema: dict[str, Any]) -> str | None:
    """xgrammar enforces multipleOf on integers only: a whole number, with both bounds or with neither."""
    if schema.get("type") != "integer":
        return "'multipleOf' on a non-integer"
    step = schema["multipleOf"]
    if not isinstance(step, int) or isinstance(step, bool):
        return "'multipleOf' that is not an integer"
    lower = "minimum" in schema or "exclusiveMinimum" in schema
    upper = "maximum" in schema or "exclusiveMaximum" in schema
    if lower != upper:
        return "'multipleOf' with only a lower or only an upper bound"
    return None
