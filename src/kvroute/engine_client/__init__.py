"""Talking to an engine (or a kvroute router) as a client, for the doctor and the canary: HTTP
requests, one chat completion, the prefix-cache counters on ``/metrics``, filler prompt text."""
