"""Constants shared by the dashboard tests' fixtures and tests (conftest.py is not importable by
name when several test folders have one)."""

SIM_PRESET = "a4000-qwen3-4b"
SIM_MODEL = "qwen3-4b"
# Fast enough that a test's few dozen requests take about a second.
SIM_SPEED = 20.0
TOKEN = "dash-secret"
