"""The run's own error for a configuration it cannot run (the bottom of the run layer: every phase raises it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the key and the fix."""
