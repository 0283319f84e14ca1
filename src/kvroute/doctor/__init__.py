"""``kvroute doctor``: what stops an engine's prefix cache, read from what the engine says about itself.

A pure core (``sources`` and ``settings``: what an engine says -> facts; ``checks``: facts ->
findings) with thin HTTP edges (``endpoint``, ``probe``, ``session``) and the command (``command``).
"""
