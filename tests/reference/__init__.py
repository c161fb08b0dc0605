"""Test machinery that must not live in ``src/``: parity helpers that copy weights into
other implementations, data helpers only tests use, and the crash launcher."""
