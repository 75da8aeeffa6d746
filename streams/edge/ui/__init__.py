"""The dashboard's static files (docs/observability.md): HTML, JS and CSS of this package and the vendored libraries
under vendor/. They hold no data: every page signs in and asks /api/* with the caller's token."""
from __future__ import annotations

from importlib import resources

TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".md": "text/plain",
         ".png": "image/png", ".svg": "image/svg+xml"}
# Nothing but this worker: no script, style or connection from elsewhere, no framing.
HEADERS = (("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
                                       "frame-ancestors 'none'"),
           ("X-Content-Type-Options", "nosniff"), ("Cache-Control", "no-cache"), ("Referrer-Policy", "no-referrer"))


def asset(name: str) -> tuple[bytes, str] | None:
    """The file `name` under this package (no way out of it), and its content type; None if there is none."""
    parts = [p for p in name.split("/") if p]
    if not parts or any(p in (".", "..") or p.startswith(".") or p.endswith(".py") for p in parts):
        return None
    ext = "." + parts[-1].rsplit(".", 1)[-1] if "." in parts[-1] else ""
    if ext not in TYPES:
        return None
    node = resources.files(__package__)
    for p in parts:
        node = node.joinpath(p)
    if not node.is_file():
        return None
    ctype = TYPES[ext] + ("; charset=utf-8" if ext in (".html", ".js", ".css", ".md") else "")
    return node.read_bytes(), ctype
