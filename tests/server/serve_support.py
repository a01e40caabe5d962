"""Constants shared by the server tests and their fixtures (not in conftest: several test
folders have one, and `from conftest import` would pick the wrong one)."""

API_KEY = "test-key"
