"""Shared fixtures come from the plugins in tests/plugins: trace paths, and the databases."""
pytest_plugins = ["tests.plugins.traces", "tests.plugins.database"]
