"""The routing table: `Route.pattern`s such as `/v1/responses/{id}/input_items`. A parameter matches one path
segment; `{name:path}` matches the rest of the path, slashes included (model aliases such as `org/model`)."""

from __future__ import annotations

import re
from typing import Sequence

from ninfer.server.context import ApiError, Route

_PARAMETER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(:path)?\}")


def _compile(pattern: str) -> re.Pattern[str]:
    parts, last = [], 0
    for match in _PARAMETER.finditer(pattern):
        value = ".+" if match.group(2) else "[^/]+"
        parts += [re.escape(pattern[last : match.start()]), f"(?P<{match.group(1)}>{value})"]
        last = match.end()
    parts.append(re.escape(pattern[last:]))
    return re.compile("".join(parts) + r"\Z")


class Router:
    def __init__(self, routes: Sequence[Route]) -> None:
        self._table = [(route, _compile(route.pattern)) for route in routes]
        seen = set()
        for route in routes:
            if (route.method, route.pattern) in seen:
                raise ValueError(f"two routes for {route.method} {route.pattern}")
            seen.add((route.method, route.pattern))

    def match(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        """The route and its path parameters; ApiError 404 for an unknown path, 405 for a known path that does not
        take `method`."""
        allowed = []
        for route, regex in self._table:
            found = regex.match(path)
            if found is None:
                continue
            if route.method == method:
                return route, found.groupdict()
            allowed.append(route.method)
        if allowed:
            raise ApiError(405, "method_not_allowed", f"{method} is not allowed on {path} (allowed: "
                           f"{', '.join(sorted(set(allowed)))})")
        raise ApiError(404, "not_found", f"no endpoint at {path}")

    def flavor_of(self, path: str) -> str:
        """The error flavor of a path, for errors raised before a route is matched (auth, unknown methods)."""
        for route, regex in self._table:
            if regex.match(path):
                return route.flavor
        return "openai"
