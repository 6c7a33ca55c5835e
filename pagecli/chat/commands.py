"""Slash commands: what the user can type besides a message, and how a line is read.

A line starting with "/" is a command; "//" sends a message that starts with "/". What each
command does is in `pagecli.chat.slash_commands`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields

from pagecli.config.settings import SamplingParams
from pagecli.config.structured import StructuredSpec
from pagecli.errors import PagecliError

# name -> (usage, what it does); the order is the order of /help.
COMMANDS: dict[str, tuple[str, str]] = {
    "help": ("/help", "this list"),
    "system": ("/system [TEXT | -]", "show, set, or (with -) clear the system prompt"),
    "reset": ("/reset", "start over (the system prompt stays)"),
    "retry": ("/retry", "a new reply to your last message, in place of the last one"),
    "undo": ("/undo", "drop the last exchange (your message and its reply)"),
    "save": ("/save [NAME]", "save the conversation as a session (default: the current one)"),
    "load": ("/load NAME", "load a saved session (later saves go to it)"),
    "stats": ("/stats", "engine and block-pool statistics"),
    "pool": ("/pool", "show or hide the block-pool panel"),
    "set": ("/set key=value ...", "sampling: temperature, top_p, top_k, min_p, max_tokens, seed, "
            "repetition_penalty, presence_penalty, frequency_penalty (no argument: show them)"),
    "format": ("/format [json | SCHEMA_FILE | off]", "replies as any JSON object, as the JSON schema in a file "
               "says, or free text again (no argument: show)"),
    "lora": ("/lora [NAME [SCALE] | off]", "replies from a LoRA adapter given with --lora (and its scale), or from "
             "the base model again (no argument: show the adapters)"),
    "exit": ("/exit", "leave (also /quit, Ctrl-D)"),
}
_ALIASES = {"quit": "exit", "q": "exit", "?": "help", "h": "help"}
SETTABLE: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                             "max_tokens": int, "seed": int, "repetition_penalty": float,
                             "presence_penalty": float, "frequency_penalty": float}


@dataclass(frozen=True)
class Command:
    name: str  # canonical name, or what was typed when unknown
    argument: str
    known: bool


def parse_line(line: str) -> Command | str:
    """A Command for a slash command, otherwise the message text."""
    text = line.strip()
    if text.startswith("//"):
        return text[1:]
    if not text.startswith("/"):
        return text
    word, _, argument = text[1:].partition(" ")
    name = _ALIASES.get(word.lower(), word.lower())
    return Command(name, argument.strip(), name in COMMANDS)


def unknown_command_hint(name: str) -> str:
    close = difflib.get_close_matches(name, list(COMMANDS), n=1)
    guess = f"; did you mean /{close[0]}?" if close else "."
    return f"Unknown command '/{name}'{guess} Type /help for the list."


def apply_settings(sampling: SamplingParams, argument: str) -> SamplingParams:
    """`/set temperature=0.2 max_tokens=64`: new sampling params, or PagecliError naming the bad part."""
    values = {f.name: getattr(sampling, f.name) for f in fields(sampling)}  # shallow: a /format spec stays
    pairs = argument.replace(",", " ").split()
    if not pairs:
        raise PagecliError("Usage: /set key=value, for example /set temperature=0.2.")
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not sep or not raw:
            raise PagecliError(f"'{pair}' is not key=value; for example /set temperature=0.2.")
        if key not in SETTABLE:
            raise PagecliError(f"Cannot set '{key}'; settable: {', '.join(SETTABLE)}.")
        values[key] = _parse_value(key, raw.strip())
    return SamplingParams(**values)


def _parse_value(key: str, raw: str) -> int | float | None:
    if key == "seed" and raw.lower() in ("none", "off", "random"):
        return None
    kind = SETTABLE[key]
    try:
        return kind(raw)
    except ValueError:
        wanted = "an integer" if kind is int else "a number"
        raise PagecliError(f"{key} must be {wanted} (got '{raw}').") from None


def describe_sampling(sampling: SamplingParams) -> str:
    return ", ".join(f"{key}={getattr(sampling, key)}" for key in SETTABLE)


def describe_format(spec: StructuredSpec | None) -> str:
    """What /format shows: how replies are constrained."""
    if spec is None:
        return "Replies are free text (/format json or /format SCHEMA_FILE constrains them)."
    if spec.kind == "json_object":
        return "Replies are JSON objects (/format off for free text)."
    return f"Replies follow a {spec.kind.replace('_', ' ')} (/format off for free text)."
