"""Schemathesis hooks for tests/openapi.rs (loaded through SCHEMATHESIS_HOOKS).

hubcast's length limits are in UTF-8 bytes, as IoT Hub counts them: a device id of at most
128 bytes, a telemetry key or method name of at most 256. JSON Schema's `maxLength` counts
characters and no keyword counts bytes, so the document states the byte limit in each field's
description and keeps `maxLength` at the same number: every value over it is schema-invalid
(and refused), but a value within it in characters can still be over it in bytes (40 four-byte
characters in a device id), and the server rightly refuses that with 400.

`positive_data_acceptance` (valid data must not get a 400) stays on for everything else. This
hook drops its failure only for that one case, and only when the request proves it: the 400's
message names a byte limit and a field, and the request carries a value for that field which
is within the limit in characters and over it in bytes. Any other 400 to schema-valid data
still fails the run.
"""

import json
import re
from urllib.parse import unquote

import schemathesis

# The server's messages for a byte limit (src/model.rs, src/api/*.rs), e.g.
# "field `deviceId` is longer than 128 bytes", "deviceId is longer than 128 bytes",
# "message 0: deviceId must be 1 to 128 bytes", "query parameter `q` is longer than 128 bytes".
BYTE_LIMIT = re.compile(r"`?(\w+)`? (?:is longer than|must be 1 to) (\d+) bytes")


def _values(data, field):
    """Every string under the key `field` anywhere in `data` (objects within arrays within …)."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key == field and isinstance(value, str):
                yield value
            else:
                yield from _values(value, field)
    elif isinstance(data, list):
        for item in data:
            yield from _values(item, field)


def _candidates(case, field):
    """The values of `field` as the server reads them: body strings as they are; path and query
    values also percent-decoded (Schemathesis keeps a path value percent-encoded in the case)."""
    yield from _values(case.body, field)
    for place in (case.path_parameters or {}, case.query or {}):
        for value in _values(place, field):
            yield value
            if "%" in value:
                yield unquote(value, errors="surrogatepass")


def _over_in_bytes_only(case, field, limit):
    """The first value of `field` in the request within `limit` characters but over `limit` bytes."""
    for value in _candidates(case, field):
        if len(value) <= limit < len(value.encode("utf-8", "surrogatepass")):
            return value
    return None


@schemathesis.hook
def filter_failure(context, failure, case, response):
    """Keeps every failure but a schema-valid value refused for its byte length (see above)."""
    if failure.code != "ST202" or response.status_code != 400:
        return True
    try:
        message = json.loads(response.content or b"{}").get("errorMessage", "")
    except (ValueError, AttributeError):
        return True
    match = BYTE_LIMIT.search(message)
    if match is None:
        return True
    field, limit = match.group(1), int(match.group(2))
    value = _over_in_bytes_only(case, field, limit)
    if value is None:
        seen = [(len(v), len(v.encode("utf-8", "surrogatepass"))) for v in _candidates(case, field)]
        print(f"schemathesis_hooks: {case.operation.label}: `{field}` refused for its {limit}-byte limit, but no value "
              f"of it is within {limit} characters and over {limit} bytes ((characters, bytes): {seen}): counted")
        return True
    # Said in the test's output, so each dropped failure can be seen to be this case.
    print(f"schemathesis_hooks: {case.operation.label}: `{field}` of {len(value)} characters, "
          f"{len(value.encode('utf-8', 'surrogatepass'))} bytes, refused for its {limit}-byte limit: not counted")
    return False
