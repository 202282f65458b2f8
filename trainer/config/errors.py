"""The configuration's error: a value or key the trainer cannot run with (a ValueError, so
every command reports it as bad input: one line, exit code 2)."""


class ConfigError(ValueError):
    """A configuration value or key the trainer cannot run with."""
