"""The fleet dashboard: a static page served by the router and the JSON snapshot it polls."""

from kvroute.server.dashboard.views import DATA_PATH, PAGE_PATH, setup_dashboard

__all__ = ["DATA_PATH", "PAGE_PATH", "setup_dashboard"]
