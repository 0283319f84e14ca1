"""The router's HTTP endpoints and the request parser agree on which routes exist."""

from __future__ import annotations

from kvroute.api.requests import ROUTES
from kvroute.server.routes import HTTP_ROUTES


def test_every_http_route_is_one_the_request_parser_knows() -> None:
    assert [route.name for route in HTTP_ROUTES] == list(ROUTES)
    assert len({route.path for route in HTTP_ROUTES}) == len(HTTP_ROUTES)
