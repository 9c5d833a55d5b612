// Time to replay N missed messages to one Socket.IO client (issue 24's measurement).
//
// usage: node loadtest/scripts/replay-socketio.mjs <baseUrl> [N=10000] [rounds=5]
// The gateway runs with the admin key in HUBCAST_ADMIN_KEY (default test-primary) and a
// session bound large enough for N d2c frames (e.g. --recovery-session-bytes 8388608).
// Per round: a new session subscribed to one device's d2c messages; the real socket.io-client
// (tests/js's, ux4iot's client) connects, receives one live message, loses its transport
// (engine.close(): what a network cut looks like to the client), N messages are ingested
// (POST /ingest, batches of 1,000) while it is away, then it reconnects with its pid and
// offset. Printed per round: ms from the reconnect to the CONNECT answer (recovered), and to
// the N-th replayed event; every event is checked once and in order.
import { createRequire } from "node:module";

const require = createRequire(new URL("../../tests/js/package.json", import.meta.url));
const { io } = require("socket.io-client");

const [base, nArg, roundsArg] = process.argv.slice(2);
const N = Number(nArg ?? 10000);
const ROUNDS = Number(roundsArg ?? 5);
const KEY = process.env.HUBCAST_ADMIN_KEY ?? "test-primary";

async function call(method, path, body, admin = false) {
  const headers = { "content-type": "application/json" };
  if (admin) headers["Shared-Access-Key"] = KEY;
  const r = await fetch(base + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await r.text();
  if (r.status >= 300) throw new Error(`${method} ${path}: ${r.status} ${text}`);
  return text ? JSON.parse(text) : null;
}

function ingest(device, from, to) {
  const batch = [];
  for (let n = from; n < to; n++) batch.push({ deviceId: device, body: { n } });
  return call("POST", "/ingest", batch, true);
}

async function round(r) {
  const device = `replay-${process.pid}-${r}`;
  const { sessionId } = await call("POST", "/session");
  const request = { sessionId, deviceId: device, type: "d2cMessages" };
  await call("PUT", "/grants", request, true);
  await call("PUT", "/subscription", request);
  const socket = io(`${base}?sessionId=${sessionId}`, { transports: ["websocket"], reconnection: false });
  let expect = 0;
  let waiter = null;
  socket.on("data", (data) => {
    const n = data.message.n;
    if (n !== expect) throw new Error(`round ${r}: got ${n}, wanted ${expect}`);
    expect++;
    if (waiter && expect === waiter.upto) waiter.done();
  });
  const until = (upto) => new Promise((done) => (expect >= upto ? done() : (waiter = { upto, done })));
  await new Promise((ok) => socket.once("connect", ok));
  await ingest(device, 0, 1);
  await until(1);
  // The transport is lost; the client keeps its pid and last offset.
  await new Promise((ok) => {
    socket.once("disconnect", ok);
    socket.io.engine.close();
  });
  for (let from = 1; from <= N; from += 1000) await ingest(device, from, Math.min(from + 1000, N + 1));
  const t0 = process.hrtime.bigint();
  socket.connect();
  await new Promise((ok) => socket.once("connect", ok));
  const connected = process.hrtime.bigint();
  if (!socket.recovered) throw new Error(`round ${r}: not recovered`);
  await until(N + 1);
  const replayed = process.hrtime.bigint();
  socket.close();
  const ms = (t) => Number(t - t0) / 1e6;
  return { round: r, n: N, recovered: socket.recovered, connect_ms: +ms(connected).toFixed(1), replay_ms: +ms(replayed).toFixed(1) };
}

const results = [];
for (let r = 0; r < ROUNDS; r++) {
  const line = await round(r);
  results.push(line);
  console.log(JSON.stringify(line));
}
const sorted = results.map((x) => x.replay_ms).sort((a, b) => a - b);
console.log(JSON.stringify({ median_replay_ms: sorted[Math.floor(sorted.length / 2)], per_message_us: +((sorted[Math.floor(sorted.length / 2)] * 1000) / N).toFixed(2) }));
process.exit(0);
