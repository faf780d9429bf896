"""The control API's OpenAPI document, made from the route table itself.

Schemas come from the view structs (``msgspec``'s JSON Schema), so the document
describes exactly what the routes return; a route is in the document exactly
when it is served.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

from gpumesh.client.views import ErrorView
from gpumesh.control.endpoints import Access
from gpumesh.version import __version__

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpumesh.control.endpoints import Endpoint

__all__ = ["document"]

_REF = "#/components/schemas/{name}"
_PARAM = re.compile(r"{(\w+)}")
_STATUS_TEXT = {200: "OK", 204: "No Content"}


def document(endpoints: Sequence[Endpoint]) -> bytes:
    types: list[Any] = [ErrorView]
    for endpoint in endpoints:
        for kind in (endpoint.response, endpoint.body):
            if kind is not None:
                types.append(kind)
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = {id(kind): schema for kind, schema in zip(types, schemas, strict=True)}
    error = {"application/json": {"schema": schema_of[id(ErrorView)]}}

    paths: dict[str, dict[str, Any]] = {}
    for endpoint in endpoints:
        content: dict[str, Any] = {}
        if endpoint.response is not None:
            content = {endpoint.media_type: {"schema": schema_of[id(endpoint.response)]}}
        elif endpoint.status != 204:
            content = {endpoint.media_type: {}}
        success: dict[str, Any] = {"description": _STATUS_TEXT.get(endpoint.status, "")}
        if content:
            success["content"] = content
        operation: dict[str, Any] = {
            "summary": endpoint.summary,
            "operationId": endpoint.handler.__name__,
            "responses": {
                str(endpoint.status): success,
                "default": {"description": "An error: its stable code and a message",
                            "content": error},
            },
        }  # fmt: skip
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PARAM.findall(endpoint.path)
        ]
        parameters += [
            {"name": q.name, "in": "query", "description": q.doc, "schema": {"type": q.kind}}
            for q in endpoint.query
        ]
        if parameters:
            operation["parameters"] = parameters
        if endpoint.body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema_of[id(endpoint.body)]}},
            }
        if endpoint.access is Access.PUBLIC:
            operation["security"] = []
        elif endpoint.access is Access.NO_COOKIE:
            operation["security"] = [{"bearer": []}]
            operation["description"] = (
                "Names local paths: the unix socket or a bearer token only, never a browser."
            )
        paths.setdefault(endpoint.path, {})[endpoint.method.lower()] = operation

    return msgspec.json.encode(
        {
            "openapi": "3.1.0",
            "info": {
                "title": "GPUMesh control API",
                "version": __version__,
                "description": (
                    "This node's API. On the unix socket $GPUMESH_HOME/control.sock no "
                    "credential is needed (the socket is the owner's); over TCP a bearer "
                    "token, or a browser session cookie (state changes then need the "
                    "X-GPUMesh-CSRF header)."
                ),
            },
            "paths": paths,
            "components": {
                "schemas": components,
                "securitySchemes": {
                    "bearer": {"type": "http", "scheme": "bearer"},
                    "cookie": {"type": "apiKey", "in": "cookie", "name": "gpumesh_session"},
                },
            },
            "security": [{"bearer": []}, {"cookie": []}],
        }
    )
