"""The fleet guard: checks the router runs on its own that keep a wrong replica out of rotation."""
