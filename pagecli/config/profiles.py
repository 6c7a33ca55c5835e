"""Profiles: TOML presets of model, engine and sampling settings (profiles/*.toml or any path).

A profile has an optional top-level `model` and `description`, an `[engine]` table whose keys
are EngineConfig fields, and a `[sampling]` table whose keys are SamplingParams fields.
Unknown keys and wrong value types are errors that name the key and the file.
"""

from __future__ import annotations

import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from pagecli.config.settings import EngineConfig, SamplingParams, field_names
from pagecli.config.structured import StructuredSpec, spec_from_schema_file
from pagecli.errors import PagecliError

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"
DEFAULT_PROFILE = "default"
_TOP_LEVEL_KEYS = ("model", "description", "engine", "sampling")


@dataclass(frozen=True)
class Profile:
    name: str
    path: Path | None
    description: str = ""
    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The profile's engine settings with non-None overrides (command-line flags) on top."""
        return _build(EngineConfig, self.engine, overrides)

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        return _build(SamplingParams, self.sampling, overrides)


def _build(cls: type, base: dict[str, Any], overrides: dict[str, Any]) -> Any:
    values = dict(base)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def available_profiles() -> list[Path]:
    return sorted(PROFILES_DIR.glob("*.toml")) if PROFILES_DIR.is_dir() else []


def find_profile(name_or_path: str | None) -> Path | None:
    """A profile name (profiles/NAME.toml) or a path to a TOML file; None when no default exists."""
    if not name_or_path:
        default = PROFILES_DIR / f"{DEFAULT_PROFILE}.toml"
        return default if default.is_file() else None
    as_path = Path(name_or_path).expanduser()
    if as_path.suffix == ".toml" or _is_file(as_path) or "/" in name_or_path:
        if not _is_file(as_path):
            missing = "is a folder, not a TOML file" if _is_dir(as_path) else "does not exist"
            raise PagecliError(f"Profile file '{name_or_path}' {missing}.")
        return as_path
    named = PROFILES_DIR / f"{name_or_path}.toml"
    if not _is_file(named):
        names = ", ".join(p.stem for p in available_profiles()) or "none"
        raise PagecliError(f"Unknown profile '{name_or_path}'; available profiles: {names}.")
    return named


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def load_profile(name_or_path: str | None = None) -> Profile:
    path = find_profile(name_or_path)
    if path is None:
        return Profile(name=DEFAULT_PROFILE, path=None)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise PagecliError(f"Cannot read profile '{path}': {exc}.") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PagecliError(f"Profile '{path}' is not valid TOML: {exc}.") from exc
    return parse_profile(data, path)


def parse_profile(data: dict[str, Any], path: Path) -> Profile:
    for key in data:
        if key not in _TOP_LEVEL_KEYS:
            raise PagecliError(
                f"Unknown key '{key}' in profile '{path}'; allowed top-level keys: {', '.join(_TOP_LEVEL_KEYS)}."
            )
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise PagecliError(f"Key 'model' in profile '{path}' must be a string.")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise PagecliError(f"Key 'description' in profile '{path}' must be a string.")
    engine = _check_table(data.get("engine", {}), EngineConfig, "engine", path)
    sampling = _check_table(data.get("sampling", {}), SamplingParams, "sampling", path)
    profile = Profile(path.stem, path, description, model or None, engine, sampling)
    _validate(profile, path)
    return profile


def _validate(profile: Profile, path: Path) -> None:
    try:
        profile.engine_config()
        profile.sampling_params()
    except PagecliError as exc:
        raise PagecliError(f"Profile '{path}': {exc}") from exc


def _check_table(table: Any, cls: type, section: str, path: Path) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise PagecliError(f"'[{section}]' in profile '{path}' must be a table.")
    hints = typing.get_type_hints(cls)
    allowed = field_names(cls)
    checked: dict[str, Any] = {}
    for key, value in table.items():
        if key not in allowed:
            raise PagecliError(
                f"Unknown key '{section}.{key}' in profile '{path}'; allowed: {', '.join(allowed)}."
            )
        if cls is SamplingParams and key == "structured":
            checked[key] = _schema_file(value, path)
            continue
        if cls is SamplingParams and key == "logit_bias" and isinstance(value, dict):
            checked[key] = value  # {"token id" = bias}: SamplingParams checks it
            continue
        checked[key] = _coerce(value, hints[key], f"{section}.{key}", path)
    return checked


def _schema_file(value: Any, path: Path) -> StructuredSpec:
    """`sampling.structured = "FILE"`: the JSON schema in FILE (relative to the profile's folder), as
    `--json-schema FILE` reads it."""
    if not isinstance(value, str) or not value:
        raise PagecliError(f"Key 'sampling.structured' in profile '{path}' must be the path of a JSON schema file "
                           f"(got {value!r}).")
    file = Path(value).expanduser()
    try:
        return spec_from_schema_file(str(file if file.is_absolute() else path.parent / file))
    except PagecliError as exc:
        raise PagecliError(f"Profile '{path}': {exc}") from None


def _coerce(value: Any, hint: Any, key: str, path: Path) -> Any:
    """Check a TOML value against a dataclass field type (int, float, str, bool, optionals, tuple[str])."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        if option is type(None):
            continue
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
    wanted = " or ".join(_type_name(o) for o in options if o is not type(None))
    raise PagecliError(f"Key '{key}' in profile '{path}' must be {wanted} (got {value!r}).")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        return "a list of strings"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


@dataclass(frozen=True)
class RunSettings:
    """What one command runs: the model as named, its profile, and the engine and sampling settings
    (the profile with the command's flags on top: pagecli.cli.options.RunFlags.settings)."""

    model: str | None
    profile: Profile
    engine: EngineConfig
    sampling: SamplingParams
