"""``kvroute canary``: are replies still correct with the prefix cache on?

``questions`` (arithmetic with exact answers, and grading), ``binomial_bound`` and ``summary`` are
pure; ``run`` sends the requests; ``command`` is the CLI.
"""
