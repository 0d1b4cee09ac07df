"""A user module that raises while it is imported (tests/integration/test_bad_input.py)."""

raise RuntimeError("broken_on_import fails on import on purpose")
