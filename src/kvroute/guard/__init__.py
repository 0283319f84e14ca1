"""The fleet guard: checks the router runs on its own replicas, and what their results do to them.

Each check keeps its findings per worker and, when told to, holds a worker out of rotation under
its own reason (``Registry.set_guard_hold``).  Pure rules (``doctor_hold``, ``drift``,
``worker_settings``; ``blocks`` registers their settings) with thin I/O beside them
(``doctor_watch``, ``drift_watch``, ``canary_runner``; the canary's rules are
``canary_watch``); docs/fleet-guard.md.
"""
