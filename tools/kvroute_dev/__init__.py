"""Developer tooling: preparing and running real inference engines beside kvroute (not used at run time)."""
