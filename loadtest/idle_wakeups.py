#!/usr/bin/env python3
"""Idle wake-ups of a hubcast process: voluntary context switches of all its threads, per second.

Starts BINARY (2 cores, throttling on), opens one session with SOCKETS plain WebSockets on it,
lets it settle, then counts voluntary_ctxt_switches over /proc/<pid>/task/*/status across
SECONDS of idleness (no ingest, no requests). Prints one line: binary, sockets, wake-ups/s,
and the pings the clients answered per second in the same window.
With PING_MS, hubcast pings every PING_MS (`--ping-interval`) and the clients answer every
ping with a pong (a thread reading all sockets), so the window holds pings; without it, the
default 25 s interval keeps pings out of the window.
Usage: idle_wakeups.py BINARY [SOCKETS=1] [SECONDS=10] [PING_MS]
"""
import base64, json, os, selectors, socket, subprocess, sys, tempfile, threading, time, urllib.request

def answer_pings(conns, stop, answered):
    """Reads every socket; answers each server ping (opcode 9) with a masked pong, counted in
    answered[0]."""
    sel = selectors.DefaultSelector()
    bufs = {}
    for c in conns:
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ)
        bufs[c] = b""
    while not stop.is_set():
        for key, _ in sel.select(0.2):
            c = key.fileobj
            try:
                data = c.recv(65536)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(c)
                continue
            buf = bufs[c] + data
            while len(buf) >= 2 and len(buf) >= 2 + (buf[1] & 0x7f):
                n = buf[1] & 0x7f
                assert n < 126, "only small control frames are expected while idle"
                opcode, payload, buf = buf[0] & 0x0f, buf[2:2 + n], buf[2 + n:]
                if opcode == 0x9:
                    mask = os.urandom(4)
                    c.setblocking(True)
                    c.sendall(bytes([0x8A, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
                    c.setblocking(False)
                    answered[0] += 1
            bufs[c] = buf

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close(); return port

def switches(pid):
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total

def main():
    binary = sys.argv[1]
    sockets = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    ping = ["--ping-interval", sys.argv[4]] if len(sys.argv) > 4 else []
    port = free_port()
    data = tempfile.mkdtemp(prefix="idle-wakeups-")
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--cores", "2",
                             "--throttling-interval", "1000", "--primary-admin-secret", "k",
                             "--data-dir", data] + ping, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        while "listening on" not in proc.stdout.readline():
            pass
        base = f"http://127.0.0.1:{port}"
        req = urllib.request.Request(base + "/session", method="POST", data=b"")
        session = json.load(urllib.request.urlopen(req))["sessionId"]
        conns = []
        for _ in range(sockets):
            c = socket.create_connection(("127.0.0.1", port))
            key = base64.b64encode(os.urandom(16)).decode()
            c.sendall((f"GET /ws?sessionId={session} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                       f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += c.recv(4096)
            assert head.startswith(b"HTTP/1.1 101"), head[:80]
            conns.append(c)
        stop = threading.Event()
        answered = [0]
        reader = threading.Thread(target=answer_pings, args=(conns, stop, answered), daemon=True)
        reader.start()
        time.sleep(1.0)  # settle: the handshakes' own wake-ups are over
        before, pings_before = switches(proc.pid), answered[0]
        time.sleep(seconds)
        after, pings_after = switches(proc.pid), answered[0]
        stop.set()
        ping_note = f"\tping={sys.argv[4]}ms" if ping else ""
        print(f"{os.path.basename(binary)}\tsockets={sockets}{ping_note}\t{(after - before) / seconds:.1f} wake-ups/s\t"
              f"{(pings_after - pings_before) / seconds:.1f} pings answered/s")
    finally:
        proc.terminate()
        proc.wait()

if __name__ == "__main__":
    main()
