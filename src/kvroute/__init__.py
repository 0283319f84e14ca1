"""kvroute: route each LLM request to the replica that already holds its prefix, never behind a busy one."""
__version__ = "0.1.0"
