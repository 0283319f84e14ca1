"""Developer tooling, not used at run time: preparing and running real inference engines beside
kvroute, and checking the package's layers (``import_graph``)."""
