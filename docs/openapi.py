"""Writes docs/openapi.json, the OpenAPI 3.1 document of hubcast's REST API.

Edit this file, then `python3 docs/openapi.py --write`; tests/openapi.rs checks that the JSON
is what this script writes, that hubcast serves it, and runs the real validators on it.
Messages in error descriptions are those of the handlers (src/api) and of the REST table in docs/PROTOCOL.md.
"""
import json
E = {"$ref": "#/components/schemas/Error"}
def err(desc):
    return {"description": desc, "content": {"application/json": {"schema": E}}}
def ok_json(desc, schema):
    return {"description": desc, "content": {"application/json": {"schema": schema}}}
def ok_text(desc, schema=None):
    return {"description": desc, "content": {"text/plain": {"schema": schema or {"type": "string"}}}}
NO = {"description": "Done; no body."}
def ref(n): return {"$ref": "#/components/schemas/" + n}
def body(schema, desc=None, required=True):
    b = {"required": required, "content": {"application/json": {"schema": schema}}}
    if desc: b["description"] = desc
    return b
KEY = [{"adminKey": []}]
KEY_OR_SESSION = [{"adminKey": []}, {"sessionId": []}]
OPEN = []
# Errors every operation can meet: malformed requests, bodies too large, and the per-core limits.
def common(resp, body_too_large=False):
    if body_too_large:
        resp.setdefault("413", err("The body is larger than `--max-body-bytes` (checked before it is read)."))
    return resp
def in_bytes(n):
    """The note on a length limit in bytes, which JSON Schema cannot state."""
    return (f"At most {n} bytes of UTF-8, as IoT Hub counts. JSON Schema's `maxLength` counts characters and no keyword counts bytes, "
            f"so `maxLength` is {n} too: a longer value is invalid, and a value within it but over {n} bytes (e.g. four-byte characters) is refused with 400 all the same.")
dev = {"name": "deviceId", "in": "path", "required": True, "description": "Device id (percent-encoded). " + in_bytes(128),
       "schema": {"type": "string", "minLength": 1, "maxLength": 128}}
key_param = {"name": "telemetryKey", "in": "path", "required": True, "description": "One telemetry key. " + in_bytes(256),
             "schema": {"type": "string", "minLength": 1, "maxLength": 256}}
bad_json = "Body is empty, not JSON, or a field is missing or of the wrong type (the message names it)."
paths = {
 "/version": {"get": {"operationId": "getVersion", "tags": ["meta"], "summary": "Server version (SPEC 1).", "security": OPEN,
   "responses": {"200": ok_text("The version, e.g. `0.1.0`.")}}},
 "/status": {"get": {"operationId": "getStatus", "tags": ["meta"], "summary": "Service status (SPEC 2): the text `OK` whatever the headers, as ux4iot (its admin SDK sends the key and returns the body as a string).", "security": OPEN,
   "responses": {"200": ok_text("`OK`: every configured source is connected.", {"type": "string", "const": "OK"}),
                 "500": err("A connection string is malformed; the message names the parameter."),
                 "503": err("`Still initializing: …` while a source (the event hub consumer, Redis) connects; `shutting down` during a graceful shutdown.")}}},
 "/status/details": {"get": {"operationId": "getStatusDetails", "tags": ["meta"], "summary": "The answering instance's details (hubcast's own): the health of `/status`, as JSON, with the instance and what it reads.", "security": KEY,
   "responses": {"200": ok_json("`status` (`OK`), and with Redis (`--redis-url`) the `instance` id, the live `instances` and the `partitions` this instance holds leases on.",
                                {"type": "object", "required": ["status"], "properties": {
                                    "status": {"type": "string", "const": "OK"}, "instance": {"type": "string"},
                                    "instances": {"type": "integer", "minimum": 1}, "partitions": {"type": "array", "items": {"type": "string"}}}}),
                 "401": err("`Unauthorized: no Shared-Access-Key header` / `… invalid Shared-Access-Key header`."),
                 "500": err("As `/status`: a connection string is malformed."),
                 "503": err("As `/status`: a source connects, or a graceful shutdown.")}}},
 "/logLevel/{level}": {"put": {"operationId": "setLogLevel", "tags": ["meta"], "summary": "Set the log level, live (SPEC 3).", "security": KEY,
   "parameters": [{"name": "level", "in": "path", "required": True, "schema": ref("LogLevel")}],
   "responses": {"204": NO, "400": err("`Unknown log level (use error, warn, info, verbose or debug)`."),
                 "401": err("`Unauthorized: no Shared-Access-Key header` / `… invalid Shared-Access-Key header`.")}}},
 "/session": {"post": {"operationId": "createSession", "tags": ["sessions"], "summary": "Open a session (SPEC 4).", "security": OPEN,
   "responses": {"200": ok_json("The new session.", ref("Session")),
                 "429": dict(err("Past the client address's rate of new sessions and handshakes (`--client-rate`, `--client-burst`; the address is the TCP peer, or `X-Forwarded-For` from a `--trusted-proxies` peer; not with the admin key): `too many new sessions or socket handshakes from this client address …`."),
                             headers={"Retry-After": {"description": "Whole seconds until the client may make one again.", "schema": {"type": "integer", "minimum": 1}}}),
                 "503": err("`session limit reached (maxSessions)`.")}}},
 "/sessions": {"delete": {"operationId": "deleteAllSessions", "tags": ["sessions"], "summary": "Delete every session (SPEC 6); their sockets close.", "security": KEY,
   "responses": {"204": NO, "401": err("Missing or invalid `Shared-Access-Key`.")}}},
 "/sessions/{sessionId}": {"delete": {"operationId": "deleteSession", "tags": ["sessions"], "summary": "Delete one session (SPEC 5); its sockets close.", "security": KEY,
   "parameters": [{"name": "sessionId", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}],
   "responses": {"204": NO, "401": err("Missing or invalid `Shared-Access-Key`."), "404": err("`The session was not found`.")}}},
 "/grants": {
   "put": {"operationId": "addGrant", "tags": ["grants"], "summary": "Forward (add) a grant (SPEC 7).", "security": KEY,
     "requestBody": body(ref("GrantRequest")),
     "responses": common({"204": NO, "400": err(bad_json + " Also `unknown grant type`, and `Grant unavailable: IoT Hub API disabled …` for directMethod, desiredProperties and deviceTwin without an IoT Hub service connection string."),
                   "401": err("Missing or invalid `Shared-Access-Key`."), "404": err("`No such sessionId`.")}, True)},
   "delete": {"operationId": "revokeGrant", "tags": ["grants"], "summary": "Revoke a grant (SPEC 8).", "security": KEY,
     "requestBody": body(ref("GrantRequest")),
     "responses": common({"204": NO, "400": err(bad_json + " Also `unknown grant type`."),
                   "401": err("Missing or invalid `Shared-Access-Key`."), "404": err("`No such sessionId`.")}, True)}},
 "/subscription": {
   "put": {"operationId": "subscribe", "tags": ["subscriptions"], "summary": "Subscribe to live data (SPEC 9); needs a covering grant.", "security": OPEN,
     "requestBody": body(ref("SubscriptionRequest")),
     "responses": common({"204": NO, "400": err(bad_json + " Also `unknown subscription type`."),
                   "403": err("`subscription request not granted`."), "404": err("`No such sessionId`.")}, True)},
   "delete": {"operationId": "unsubscribe", "tags": ["subscriptions"], "summary": "Unsubscribe (SPEC 10); needs the grant, like ux4iot.", "security": OPEN,
     "requestBody": body(ref("SubscriptionRequest")),
     "responses": common({"204": NO, "400": err(bad_json + " Also `unknown subscription type`."),
                   "403": err("`subscription request not granted`."), "404": err("`No such sessionId`.")}, True)}},
}
bulk_body = {"oneOf": [{"type": "array", "items": ref("BulkSubscriptionRequest")},
                       {"type": "object", "required": ["subscriptionRequests"],
                        "properties": {"subscriptionRequests": {"type": "array", "items": ref("BulkSubscriptionRequest")}}}]}
sess_hdr = {"name": "sessionId", "in": "header", "required": False, "description": "The session of elements that name none (see BulkSubscriptionRequest).", "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]+$"}}
for m, op, summ in [("put", "subscribeBulk", "Bulk subscribe (SPEC 11)"), ("delete", "unsubscribeBulk", "Bulk unsubscribe (SPEC 12)")]:
    paths.setdefault("/subscriptions", {})[m] = {"operationId": op, "tags": ["subscriptions"],
      "summary": summ + ": every element is validated first (one bad element: 400, nothing applied); elements without a grant are skipped.",
      "security": OPEN, "parameters": [sess_hdr], "requestBody": body(bulk_body),
      "responses": common({"200": ok_json("The applied elements, exactly as sent.", {"type": "array", "items": ref("BulkSubscriptionRequest")}),
                    "400": err("`Not all elements in the request body are subscription requests: element N: …`, or the body is not an array / `{subscriptionRequests: […]}`."),
                    "404": err("`No such sessionId`.")}, True)}
reader_errors = lambda what, nf: {
    "400": err("`deviceId is longer than 128 bytes` / `telemetryKey is longer than 256 bytes`."),
    "401": err("`Provide either a Shared-Access-Key or a sessionId header`."),
    "403": err(f"`Forbidden to read {what}: missing grant` / `… invalid shared-access-key`."),
    "404": err(nf + " / `No such sessionId`."),
}
hub_errors = {"502": err("The IoT Hub broke the connection off or answered something unusable."),
              "503": err("`IoT Hub client busy…` / `IoT Hub unreachable (…)`."),
              "504": err("`IoT Hub did not answer within N s`.")}
paths["/lastValue/{deviceId}"] = {
  "get": {"operationId": "getLastValues", "tags": ["last values"], "summary": "Every last telemetry value of a device (SPEC 13).", "security": KEY_OR_SESSION,
    "parameters": [dev], "responses": {"200": ok_json("Each key with its value and time.", ref("AllLastValues")), **reader_errors("last value of device", "`No last telemetry found`")}},
  "delete": {"operationId": "deleteLastValues", "tags": ["last values"], "summary": "Remove every last value of a device (SPEC 14); a session needs the wildcard telemetry grant.", "security": KEY_OR_SESSION,
    "parameters": [dev], "responses": {"204": NO, **reader_errors("last value of device", "`No last telemetry found`")}}}
paths["/lastValue/{deviceId}/{telemetryKey}"] = {
  "get": {"operationId": "getLastValue", "tags": ["last values"], "summary": "One last telemetry value (SPEC 13).", "security": KEY_OR_SESSION,
    "parameters": [dev, key_param], "responses": {"200": ok_json("The key's last value.", ref("LastValue")), **reader_errors("last value of device", "`No last telemetry found`")}}}
paths["/deviceTwin/{deviceId}"] = {
  "get": {"operationId": "getDeviceTwin", "tags": ["last values"], "summary": "Last device twin (SPEC 15): from the IoT Hub (cached per `deviceTwinCacheTTL`) or, without one, from twin change events.", "security": KEY_OR_SESSION,
    "parameters": [dev], "responses": {"200": ok_json("The twin.", ref("TwinRecord")), **reader_errors("device twin", "`No last devicetwin found`"), **hub_errors}}}
paths["/connectionState/{deviceId}"] = {
  "get": {"operationId": "getConnectionState", "tags": ["last values"], "summary": "Last connection state (SPEC 16).", "security": KEY_OR_SESSION,
    "parameters": [dev], "responses": {"200": ok_json("The state.", ref("ConnectionStateRecord")), **reader_errors("connection state", "`No device found`"), **hub_errors}}}
hub_disabled = ("`IoT Hub API disabled, …`: this server has no IoT Hub service connection string (its configuration, not the request: every request gets it, "
                "as in ux4iot); or a malformed body (the message names the field).")
caller = {"401": err("Neither header, or an invalid `Shared-Access-Key`."), "403": err("`Forbidden: missing grant`."),
          "404": err("`No such sessionId`, or the hub's 404 (device unknown or offline).")}
fwd = "Any other 4xx/5xx the IoT Hub answered is forwarded with its status and message."
paths["/directMethod"] = {"post": {"operationId": "invokeDirectMethod", "tags": ["device hub"], "summary": "Execute a direct method (SPEC 17). " + fwd, "security": KEY_OR_SESSION,
   "requestBody": body(ref("DirectMethodRequest")),
   "responses": common({"200": ok_json("The device's answer; `status` is the device's own.", ref("HubResult")), "400": err(hub_disabled), **caller,
                 "412": err("Forwarded from the IoT Hub."), "429": err("Forwarded from the IoT Hub."), "500": err("Forwarded from the IoT Hub."),
                 **hub_errors, "413": err("`methodParams.payload is N bytes; IoT Hub accepts at most 128 KiB`, or the body exceeds `--max-body-bytes`.")})}}
paths["/deviceTwinDesiredProperties"] = {"patch": {"operationId": "patchDesiredProperties", "tags": ["device hub"], "summary": "Patch desired properties (SPEC 18). " + fwd, "security": KEY_OR_SESSION,
   "requestBody": body(ref("DesiredPropertiesRequest")),
   "responses": common({"200": ok_json("`payload` is the hub's updated twin.", ref("HubResult")), "400": err(hub_disabled), **caller,
                 "412": err("Forwarded from the IoT Hub."), "429": err("Forwarded from the IoT Hub."), "500": err("Forwarded from the IoT Hub."),
                 **hub_errors, "413": err("`desiredPropertyPatch is N bytes; IoT Hub accepts at most 32 KiB`, or the body exceeds `--max-body-bytes`.")})}}
paths["/ingest"] = {"post": {"operationId": "ingest", "tags": ["hubcast"], "summary": "HTTP ingest: device messages in the event stream's shape; answers once they are applied.", "security": KEY,
   "requestBody": body({"oneOf": [ref("IngestMessage"), {"type": "array", "items": ref("IngestMessage")}]}),
   "responses": common({"200": ok_json("How many messages were applied.", {"type": "object", "required": ["accepted"], "properties": {"accepted": {"type": "integer", "minimum": 0}}}),
                 "400": err("Names the bad message and field (`message N: …`)."), "401": err("Missing or invalid `Shared-Access-Key`.")}, True)}}
paths["/metrics"] = {"get": {"operationId": "getMetrics", "tags": ["hubcast"], "summary": "Prometheus text format, summed over all cores. Open with `--metrics-open`.", "security": KEY,
   "responses": {"200": ok_text("Prometheus exposition format 0.0.4."), "401": err("Missing or invalid `Shared-Access-Key`.")}}}
paths["/devices"] = {"get": {"operationId": "listDevices", "tags": ["hubcast"], "summary": "The console's device list: devices whose id contains `q`, in id order, paged by cursor (`after` = the previous page's `next`).", "security": KEY,
   "parameters": [{"name": "q", "in": "query", "required": False, "description": "Substring of the device id (case-sensitive). " + in_bytes(128), "schema": {"type": "string", "maxLength": 128}},
                  {"name": "after", "in": "query", "required": False, "description": "Only devices whose id sorts after this one. " + in_bytes(128), "schema": {"type": "string", "maxLength": 128}},
                  {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "maximum": 200, "default": 50}}],
   "responses": {"200": ok_json("One page.", ref("DevicePage")),
                 "400": err("`query parameter `limit` is `N`; it must be a whole number from 1 to 200` / `query parameter `q` is longer than 128 bytes`."),
                 "401": err("Missing or invalid `Shared-Access-Key`.")}}}
paths["/console"] = {"get": {"operationId": "getConsole", "tags": ["hubcast"], "summary": "The live operator console (an HTML page; it asks for the admin key itself).", "security": OPEN,
   "responses": {"200": {"description": "The page.", "content": {"text/html": {"schema": {"type": "string"}}}}}}}
paths["/openapi.json"] = {"get": {"operationId": "getOpenApi", "tags": ["hubcast"], "summary": "This document.", "security": OPEN,
   "responses": {"200": ok_json("The OpenAPI 3.1 document.", {"type": "object"})}}}

S = {}
S["Error"] = {"type": "object", "required": ["errorMessage"], "properties": {"errorMessage": {"type": "string", "description": "What was wrong, naming the field or limit."}}}
S["LogLevel"] = {"type": "string", "enum": ["error", "warn", "info", "verbose", "debug"]}
S["Session"] = {"type": "object", "required": ["sessionId"], "properties": {"sessionId": {"type": "string", "description": "128 random bits, 22 URL-safe characters."}}}
grant_types = ["telemetry", "deviceTwin", "connectionState", "d2cMessages", "desiredProperties", "directMethod"]
key_field = {"type": ["string", "null"], "maxLength": 256}
def only_for(kind, field):
    """`field` is read (and checked) only when `type` is `kind`; the server ignores it otherwise, whatever it holds."""
    return {"if": {"properties": {"type": {"const": kind}}, "required": ["type"]}, "then": {"properties": {field: key_field}}}
S["GrantRequest"] = {"type": "object", "required": ["sessionId", "deviceId", "type"],
  "description": "The ux4iot 3.x grant. `telemetryKey` applies to telemetry grants, `directMethodName` to directMethod grants; null or absent = every key. "
                 "A ux4iot 1.x/2.x grant (a `grantType` field, or a 2.x type such as `subscribeToTelemetry`, `modifyDesiredProperties`, `invokeDirectMethod`) "
                 "is refused with 400 naming the 3.x type to send: in 2.x a grant also subscribed, in 3.x it only permits.",
  "properties": {"sessionId": {"type": "string"}, "deviceId": {"type": "string", "minLength": 1, "maxLength": 128, "description": in_bytes(128)},
                 "type": {"type": "string", "enum": grant_types},
                 "telemetryKey": {"description": "Telemetry grants: a string or null (null or absent = every key). " + in_bytes(256) + " Ignored for other types."},
                 "directMethodName": {"description": "directMethod grants: a string or null (null or absent = every method). " + in_bytes(256) + " Ignored for other types."}},
  "allOf": [only_for("telemetry", "telemetryKey"), only_for("directMethod", "directMethodName")]}
sub_props = {"sessionId": {"type": "string"}, "deviceId": {"type": "string", "minLength": 1, "maxLength": 128, "description": in_bytes(128)},
             "type": {"type": "string", "enum": ["telemetry", "deviceTwin", "connectionState", "d2cMessages"]},
             "telemetryKey": {"description": "Telemetry subscriptions: a string or null (null or absent = every key, which needs the wildcard grant). " + in_bytes(256) + " Ignored for other types."}}
S["SubscriptionRequest"] = {"type": "object", "required": ["sessionId", "deviceId", "type"], "properties": sub_props, "allOf": [only_for("telemetry", "telemetryKey")]}
S["BulkSubscriptionRequest"] = {"type": "object", "required": ["sessionId", "deviceId", "type"],
  "description": "An element may also leave out `sessionId` when the request has a `sessionId` header (the Node admin SDK's form): the header's session is taken. "
                 "OpenAPI cannot make a body field depend on a header, so this schema states the form that stands alone; an element with neither is refused with 400 (`missing field `sessionId``).",
  "properties": sub_props, "allOf": [only_for("telemetry", "telemetryKey")]}
ts = {"type": "string", "description": "ISO 8601 UTC time with milliseconds (empty in the all-keys record)."}
S["LastValue"] = {"type": "object", "required": ["deviceId", "data", "timestamp"],
  "properties": {"deviceId": {"type": "string"}, "data": {"type": "object", "description": "`{key: value}`"}, "timestamp": ts}}
S["AllLastValues"] = {"type": "object", "required": ["deviceId", "data", "timestamp"],
  "properties": {"deviceId": {"type": "string"}, "timestamp": ts,
                 "data": {"type": "object", "additionalProperties": {"type": "object", "required": ["value", "timestamp"], "properties": {"value": {}, "timestamp": {"type": "string"}}}}}}
S["TwinRecord"] = {"type": "object", "required": ["deviceId", "data", "timestamp"], "properties": {"deviceId": {"type": "string"}, "data": {"description": "The twin document."}, "timestamp": ts}}
S["ConnectionStateRecord"] = {"type": "object", "required": ["deviceId", "data", "timestamp"], "properties": {"deviceId": {"type": "string"}, "data": {"type": "boolean"}, "timestamp": ts}}
S["DirectMethodRequest"] = {"type": "object", "required": ["deviceId", "methodParams"],
  "properties": {"deviceId": {"type": "string", "minLength": 1, "maxLength": 128, "description": in_bytes(128)},
                 "methodParams": {"type": "object", "required": ["methodName"],
                   "properties": {"methodName": {"type": "string", "maxLength": 256, "description": in_bytes(256)}, "payload": {"description": "At most 128 KiB as JSON text (a size JSON Schema cannot state; larger: 413)."},
                                  "responseTimeoutInSeconds": {"type": ["number", "null"]}, "connectTimeoutInSeconds": {"type": ["number", "null"]}}}}}
S["DesiredPropertiesRequest"] = {"type": "object", "required": ["deviceId", "desiredPropertyPatch"],
  "properties": {"deviceId": {"type": "string", "minLength": 1, "maxLength": 128, "description": in_bytes(128)}, "desiredPropertyPatch": {"type": "object", "description": "At most 32 KiB as JSON text (a size JSON Schema cannot state; larger: 413)."}}}
S["HubResult"] = {"type": "object", "required": ["status", "payload"], "properties": {"status": {}, "payload": {}}}
S["IngestMessage"] = {"type": "object", "required": ["deviceId", "body"],
  "properties": {"deviceId": {"type": "string", "minLength": 1, "maxLength": 128, "description": "May be left out when the body holds it under `customDeviceIdKey`. " + in_bytes(128)},
                 "source": {"enum": ["Telemetry", "twinChangeEvents", "deviceConnectionStateEvents", "deviceLifecycleEvents", None], "default": "Telemetry", "description": "null or absent: Telemetry."},
                 "properties": {"type": ["object", "null"], "additionalProperties": {"type": ["string", "number", "boolean"]}},
                 "enqueuedTime": {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}],
                                  "description": "RFC 3339 date-time (ISO 8601 with an offset; one without is taken as UTC), or null: absent or null = the time it arrived. Any other string is refused with 400."},
                 "body": {"description": "The message body (any JSON)."}}}
S["DevicePage"] = {"type": "object", "required": ["total", "devices", "next"],
  "properties": {"total": {"type": "integer", "minimum": 0, "description": "Devices matching `q`, on all pages."},
                 "next": {"type": ["string", "null"], "description": "`after` for the next page; null on the last one."},
                 "devices": {"type": "array", "items": {"type": "object", "required": ["deviceId", "connected", "lastSeen", "telemetry", "telemetryKeys", "hasTwin"],
                   "properties": {"deviceId": {"type": "string"}, "connected": {"type": ["boolean", "null"], "description": "null: unknown."},
                                  "lastSeen": {"type": ["string", "null"], "description": "Newest time of its values and connection state."},
                                  "telemetry": {"type": "object", "description": "Up to 12 last values, by key (sorted)."},
                                  "telemetryKeys": {"type": "integer", "minimum": 0, "description": "How many keys it has in all."},
                                  "hasTwin": {"type": "boolean"}}}}}}
doc = {
 "openapi": "3.1.0",
 "info": {"title": "hubcast REST API", "version": "0.1.0",
          "description": "The REST API of hubcast: ux4iot's 18 endpoints (SPEC.md) plus hubcast's own. Errors are always `{\"errorMessage\": \"…\"}`. A connection past the connection cap (`--max-connections`, or the open-file limit less `--fd-reserve`) is answered 503 `connection limit reached …` with `Connection: close` and `Retry-After` on any route but `GET /status`. Live data goes over Socket.IO (`/socket.io/`) and plain WebSocket (`/ws?sessionId=…`), which OpenAPI does not describe (see docs/PROTOCOL.md).",
          "license": {"name": "see repository"}},
 "servers": [{"url": "/"}],
 "security": KEY,
 "tags": [{"name": t} for t in ["meta", "sessions", "grants", "subscriptions", "last values", "device hub", "hubcast"]],
 "paths": paths,
 "components": {"schemas": S, "securitySchemes": {
   "adminKey": {"type": "apiKey", "in": "header", "name": "Shared-Access-Key", "description": "The primary or secondary admin secret."},
   "sessionId": {"type": "apiKey", "in": "header", "name": "sessionId", "description": "A session id from `POST /session`; its grants are checked."}}},
}
if __name__ == "__main__":
    import sys
    text = json.dumps(doc, indent=2)
    if len(sys.argv) > 1 and sys.argv[1] == "--write":
        with open(__file__.replace("openapi.py", "openapi.json"), "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
