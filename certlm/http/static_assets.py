"""Files of certlm's own web pages (``/docs``, the dashboard) served from the package: only known suffixes with fixed
media types, under URLs that carry a fingerprint of the content so that browsers may keep them until certlm ships
different files.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path, PurePosixPath

from quart import Response, request, send_from_directory, url_for

from certlm.foundation.errors import NotFound

# The MIME type is fixed here rather than guessed from the machine's mime.types.
ASSET_MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png", ".svg": "image/svg+xml"}
IMMUTABLE_MAX_AGE_S = 365 * 24 * 3600


class StaticAssets:
    """The servable files below ``directory`` (those of ``suffixes``), served by the route ``endpoint`` with a
    ``filename`` parameter."""

    def __init__(self, directory: Path, endpoint: str, suffixes: tuple[str, ...], headers: dict[str, str]) -> None:
        self.directory = directory
        self.endpoint = endpoint
        self.suffixes = suffixes
        self.headers = headers

    @cached_property
    def fingerprints(self) -> dict[str, str]:
        """Every servable file, by its path below the directory, with a digest of its content."""
        return {
            path.relative_to(self.directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()[:16]
            for path in sorted(self.directory.rglob("*"))
            if path.is_file() and path.suffix in self.suffixes
        }

    def url(self, filename: str) -> str:
        return url_for(self.endpoint, filename=filename, v=self.fingerprints[filename])

    async def send(self, filename: str) -> Response:
        """``filename``: kept for a year by browsers under its current fingerprint, revalidated otherwise; 404 for
        anything that is not a servable file."""
        fingerprint = self.fingerprints.get(filename)
        if fingerprint is None:
            raise NotFound("not found")
        current = request.args.get("v") == fingerprint
        response = await send_from_directory(
            self.directory,
            filename,
            mimetype=ASSET_MEDIA_TYPES[PurePosixPath(filename).suffix],
            cache_timeout=IMMUTABLE_MAX_AGE_S if current else 0,
        )
        if current:
            response.cache_control.immutable = True
        else:
            response.cache_control.no_cache = True
        response.headers.update(self.headers)
        return response
