#!/usr/bin/env python3
"""RSS per idle MQTT client of a Mosquitto broker, each client subscribed to S topics: the
peer figure of issue 25 item 3 (hubcast's side: `hubcast-load ... idle --clients C --subs S`).

    python3 loadtest/mqtt_idle.py [--clients 10000] [--subs 10] [--devices 1000] [--hold 5]

Starts its own `mosquitto` (no persistence) on a free loopback port, pinned to CPU 0 when
`--pin` is given, reads its RSS (/proc/PID/status VmRSS) before any client, opens C MQTT 3.1.1
connections (one client id each, clean session, keep-alive 600 s so nothing is sent while
idle), subscribes each to S topics `devices/dev-NNNNNN/telemetry` (QoS 0, S consecutive
devices of D, as hubcast-load spreads subscriptions) and waits for every SUBACK, holds them
`--hold` seconds, reads the RSS again and prints KiB per client.

`--websockets`: the clients connect over Mosquitto's WebSocket listener (MQTT in binary
frames, subprotocol `mqtt`), as issue 25 measured it and as hubcast's sockets are; without
it, over plain TCP. Mosquitto 2.0.11 refuses to start with a WebSocket listener alone ("Unable
to start any listening sockets", the reason an earlier version of this script said it had no
WebSocket support): a TCP listener beside it, unused, lets it start.
"""
import base64
import argparse
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def remaining(n):
    out = bytearray()
    while True:
        b = n % 128
        n //= 128
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def mqtt_str(s):
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def connect_packet(client_id):
    var = mqtt_str("MQTT") + bytes([4, 0x02]) + struct.pack(">H", 600)
    payload = mqtt_str(client_id)
    body = var + payload
    return bytes([0x10]) + remaining(len(body)) + body


def subscribe_packet(packet_id, topics):
    body = struct.pack(">H", packet_id) + b"".join(mqtt_str(t) + b"\x00" for t in topics)
    return bytes([0x82]) + remaining(len(body)) + body


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise RuntimeError("closed")
        data += chunk
    return data


def ws_upgrade(sock):
    """Sends the WebSocket upgrade request; [`ws_upgraded`] reads the answer."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n".encode()
    )


def ws_upgraded(sock):
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += recv_exact(sock, 1)
    assert head.startswith(b"HTTP/1.1 101"), head


def ws_frame(payload):
    """A masked binary frame (a client's)."""
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x82, 0x80 | n]) if n < 126 else bytes([0x82, 0x80 | 126]) + struct.pack(">H", n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def ws_read_packet(sock):
    """One MQTT packet from the server's (unmasked) binary frame."""
    b0, b1 = recv_exact(sock, 2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack(">H", recv_exact(sock, 2))[0]
    elif n == 127:
        n = struct.unpack(">Q", recv_exact(sock, 8))[0]
    data = recv_exact(sock, n)
    i, mult, length = 1, 1, 0
    while True:
        b = data[i]
        i += 1
        length += (b & 0x7F) * mult
        mult *= 128
        if not b & 0x80:
            break
    return data[0], data[i:i + length]


def read_packet(sock):
    head = sock.recv(1)
    if not head:
        raise RuntimeError("closed")
    mult, n = 1, 0
    while True:
        b = sock.recv(1)[0]
        n += (b & 0x7F) * mult
        mult *= 128
        if not b & 0x80:
            break
    return head[0], recv_exact(sock, n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=10000)
    ap.add_argument("--subs", type=int, default=10)
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--hold", type=float, default=5.0)
    ap.add_argument("--pin", action="store_true", help="pin mosquitto to CPU 0 and this script to CPU 1")
    ap.add_argument("--websockets", action="store_true", help="clients over the WebSocket listener")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    def free_port():
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        return port

    port = free_port()
    conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
    conf.write(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_connections -1\n")
    ws_port = None
    if args.websockets:
        ws_port = free_port()
        conf.write(f"listener {ws_port} 127.0.0.1\nprotocol websockets\n")
    send = (lambda s, b: s.sendall(ws_frame(b))) if ws_port else (lambda s, b: s.sendall(b))
    read = ws_read_packet if ws_port else read_packet
    conf.close()
    cmd = ["mosquitto", "-c", conf.name]
    if args.pin:
        cmd = ["taskset", "-c", "0"] + cmd
        os.sched_setaffinity(0, {1})
    broker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", ws_port or port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        time.sleep(0.5)
        before = rss_kb(broker.pid)
        socks = []
        started = time.time()
        # Mosquitto answers an upgrade request ~0.1-0.2 s after it arrives (its loop's tick):
        # upgrades are sent a batch at a time, then each client goes on in turn.
        batch = 500 if ws_port else 1
        for first in range(0, args.clients, batch):
            opened = []
            for c in range(first, min(first + batch, args.clients)):
                s = socket.create_connection(("127.0.0.1", ws_port or port))
                if ws_port:
                    ws_upgrade(s)
                opened.append((c, s))
            for c, s in opened:
                if ws_port:
                    ws_upgraded(s)
                send(s, connect_packet(f"idle-{c}"))
                kind, _ = read(s)
                assert kind >> 4 == 2, "CONNACK"
                topics = [f"devices/dev-{(c * args.subs + j) % args.devices:06d}/telemetry" for j in range(args.subs)]
                if topics:
                    send(s, subscribe_packet(1, topics))
                    kind, data = read(s)
                    assert kind >> 4 == 9 and all(b == 0 for b in data[2:]), "SUBACK"
                socks.append(s)
        took = time.time() - started
        time.sleep(args.hold)
        held = rss_kb(broker.pid)
        per = (held - before) / len(socks)
        print(
            f"mosquitto {subprocess.run(['mosquitto', '-h'], capture_output=True, text=True).stdout.splitlines()[0].split()[-1]}: "
            f"{len(socks)} clients x {args.subs} subscriptions ({'WebSocket' if ws_port else 'TCP'}), rss_start_kb {before}, rss_held_kb {held}, "
            f"kb_per_client {per:.3f}, connect {len(socks) / took:.0f}/s"
        )
        for s in socks:
            s.close()
    finally:
        broker.terminate()
        broker.wait()
        os.unlink(conf.name)


if __name__ == "__main__":
    sys.exit(main())
