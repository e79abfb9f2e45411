"""The API's pages, ``/docs`` (Swagger UI) and ``/redoc``, with their assets served from a
package: they work offline.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so on a machine without internet
(or behind a proxy that blocks it) ``/docs`` stayed blank. The assets come from the
``fastapi-offline`` package (Swagger UI 5, which reads OpenAPI 3.1), installed with lmhead;
only its files are used. Page and assets are addressed under the app's ``root_path``, so a
service mounted behind a path prefix serves them too.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, HTMLResponse

router = APIRouter(include_in_schema=False)
ASSETS_PATH = "/docs/assets"
#: The files a page loads, and their media types: nothing else is served from the package.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
#: The assets change only with the package: a browser may keep them a day.
CACHED = {"cache-control": "public, max-age=86400"}


def assets_dir() -> Path:
    """Where the package keeps the assets (a directory of the installed package)."""
    return Path(str(resources.files("fastapi_offline") / "static"))


def _asset(request: Request, name: str) -> str:
    root = request.scope.get("root_path", "")
    return f"{root}{ASSETS_PATH}/{name}"


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI: the document, and "try it out" for every operation."""
    return get_swagger_ui_html(
        openapi_url=request.scope.get("root_path", "") + request.app.openapi_url,
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=_asset(request, "swagger-ui-bundle.js"),
        swagger_css_url=_asset(request, "swagger-ui.css"),
        swagger_favicon_url=_asset(request, "favicon.png"),
    )


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    """ReDoc: the document as one page (no web fonts: nothing is fetched from elsewhere)."""
    return get_redoc_html(
        openapi_url=request.scope.get("root_path", "") + request.app.openapi_url,
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=_asset(request, "redoc.standalone.js"),
        redoc_favicon_url=_asset(request, "favicon.png"),
        with_google_fonts=False,
    )


@router.get(ASSETS_PATH + "/{name}")
async def asset(name: str) -> FileResponse:
    """One of ``ASSETS``, by its exact name (never a path: nothing else can be read)."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(404, f"no asset {name[:64]!r}; the pages' assets: {', '.join(ASSETS)}")
    return FileResponse(assets_dir() / name, media_type=media_type, headers=CACHED)
