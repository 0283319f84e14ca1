"""Engine diagnostics behind ``kvroute doctor`` and ``kvroute canary``.

A pure core (parsing what an engine says about itself into facts, and facts into findings) with
thin HTTP edges (``fetch``, ``probe_run``, ``canary_run``) around it.
"""
