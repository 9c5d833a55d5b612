#!/usr/bin/env python3
"""PUT /subscriptions of N devices, timed, with what Redis did for it (issue 23, design step 8).

Called by docs/benchmarks/redis-cluster.sh; standard library only.
  redis-cluster-subs.py MODE URL_A URL_B KEY PORTS N
MODE: `one` (only A is up), `copy` (B is up and holds a copy of the session: a subscription
made there first, as tests/cluster.rs does), `socket` (a plain WebSocket on B for the
session, so B must start watching every device: the time also runs until A knows that B
watches all N, i.e. until data would cross). PORTS: the Redis nodes, comma-separated; their
`INFO commandstats` before and after give the commands (all clients: a heartbeat falling in
the window shows as `evalsha`/`zadd`/`set`, hence the script's long --lease-ttl).
Prints one line: `put_ms=… ready_ms=… cmds=<node>:<cmd>=<calls>,…`.
"""

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.parse


def conn(url):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=30)


def call(c, method, path, key=None, body=None):
    headers = {"content-type": "application/json"}
    if key:
        headers["shared-access-key"] = key
    c.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    r = c.getresponse()
    return r.status, r.read()


def commandstats(ports):
    out = {}
    for p in ports:
        text = subprocess.run(["redis-cli", "-p", p, "info", "commandstats"], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            if line.startswith("cmdstat_"):
                name, rest = line[len("cmdstat_"):].split(":", 1)
                calls = int(rest.split(",")[0].split("=")[1])
                out[(p, name)] = calls
    return out


def metric(url, key, name):
    c = conn(url)
    _, body = call(c, "GET", "/metrics", key)
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def open_ws(url, session):
    u = urllib.parse.urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    s.sendall(
        (
            f"GET /ws?sessionId={session} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def main():
    mode, url_a, url_b, key, ports, n = sys.argv[1:7]
    ports, n = ports.split(","), int(n)
    a = conn(url_a)
    status, body = call(a, "POST", "/session")
    assert status == 200, body
    session = json.loads(body)["sessionId"]
    devices = [f"bulk-{session[:8]}-{i}" for i in range(n)]
    for d in devices:
        status, body = call(a, "PUT", "/grants", key, {"sessionId": session, "type": "telemetry", "deviceId": d})
        assert status == 204, body
    ws = None
    if mode == "copy":
        b = conn(url_b)
        status, body = call(b, "PUT", "/subscription", None, {"sessionId": session, "type": "telemetry", "deviceId": devices[0]})
        assert status == 204, body
    elif mode == "socket":
        ws = open_ws(url_b, session)
        # B holds the session once the socket is up; nothing is watched yet.
    elsewhere = 'hubcast_redis_watched_elsewhere_devices{instance="a"}'
    watched_before = metric(url_a, key, elsewhere) if mode == "socket" else 0
    before = commandstats(ports)
    body = [{"sessionId": session, "type": "telemetry", "deviceId": d} for d in devices]
    started = time.monotonic()
    status, answer = call(a, "PUT", "/subscriptions", None, body)
    put_ms = (time.monotonic() - started) * 1000
    assert status == 200, answer
    assert len(json.loads(answer)) == n, answer[:200]
    ready_ms = put_ms
    if mode == "socket":
        deadline = time.monotonic() + 20
        while (seen := metric(url_a, key, elsewhere)) < watched_before + n:
            if time.monotonic() > deadline:
                ready_ms = f"never(A_saw={seen - watched_before:.0f}_in_20s)"
                break
            time.sleep(0.005)
        else:
            ready_ms = (time.monotonic() - started) * 1000
    after = commandstats(ports)
    delta = sorted((p, c, after[(p, c)] - before.get((p, c), 0)) for (p, c) in after if after[(p, c)] - before.get((p, c), 0) > 0 and c != "info")
    ready = f"{ready_ms:.1f}" if isinstance(ready_ms, float) else ready_ms
    print(f"put_ms={put_ms:.1f} ready_ms={ready} cmds=" + ",".join(f"{p}:{c}={k}" for p, c, k in delta))
    if ws:
        ws.close()


if __name__ == "__main__":
    main()
