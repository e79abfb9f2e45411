"""Wire formats: each front end decodes a request into the data plane's typed message in one
call and encodes the typed result in one call (``native`` for ``/v1``, ``v2`` for the Open
Inference Protocol); ``wire`` holds what both read: bodies, media types, arrays, the target."""
