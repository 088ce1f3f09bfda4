"""Command-line flags: `define_flags()` declares them (no side effect on import) and
`config_from_flags()` turns parsed flags into the engine's frozen Config."""

from flags.definitions import config_from_flags, define_flags

__all__ = ["config_from_flags", "define_flags"]
