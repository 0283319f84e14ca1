"""Helpers of ``benchmarks/peers.py``: kvroute side by side with vllm-router and sglang-router.

* ``routers``    — which routers and policies run, and the loopback-only command line of each;
* ``venvs``      — one cached virtual environment per peer router;
* ``procs``      — starting, waiting for and stopping the processes of one run;
* ``placements`` — which replica served each session round, as the replicas saw it;
* ``simfleet``   — ``kvroute sim``'s replicas with a placement log (run as a script);
* ``cost``       — the router-cost load (small requests, 64 concurrent clients);
* ``report``     — tables as ratios to kvroute, and plots.
"""
