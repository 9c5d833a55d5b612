// Redis commands and bytes per device message with two instances (issue 24's measurement).
//
// usage: node loadtest/scripts/recovery-redis.mjs <urlA> <urlB> <redis-port> [M=20000]
// A socket.io client on B subscribed to device `watched`'s d2c messages (never conflated); A ingests M of its messages
// (POST /ingest, batches of 500) until the client has them all; then M messages of a device
// nobody watches. Per phase, from INFO on the instances' own redis-server: commands
// processed, PUBLISH/SPUBLISH calls, and bytes in and out, each per message. Background
// traffic (leases, heartbeats) is included: run it on a redis-server of its own.
import { createRequire } from "node:module";
import { execFileSync } from "node:child_process";

const require = createRequire(new URL("../../tests/js/package.json", import.meta.url));
const { io } = require("socket.io-client");

const [urlA, urlB, port, mArg] = process.argv.slice(2);
const M = Number(mArg ?? 20000);
const KEY = process.env.HUBCAST_ADMIN_KEY ?? "test-primary";

async function call(base, method, path, body, admin = false) {
  const headers = { "content-type": "application/json" };
  if (admin) headers["Shared-Access-Key"] = KEY;
  const r = await fetch(base + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await r.text();
  if (r.status >= 300) throw new Error(`${method} ${path}: ${r.status} ${text}`);
  return text;
}

function info() {
  const text = execFileSync("redis-cli", ["-p", port, "INFO", "all"]).toString();
  const field = (name) => Number((text.match(new RegExp(`^${name}:(\\d+)`, "m")) ?? [])[1] ?? 0);
  const calls = (cmd) => Number((text.match(new RegExp(`^cmdstat_${cmd}:calls=(\\d+)`, "m")) ?? [])[1] ?? 0);
  return { commands: field("total_commands_processed"), publish: calls("publish") + calls("spublish"), in: field("total_net_input_bytes"), out: field("total_net_output_bytes") };
}

function per(before, after) {
  const d = (k) => +((after[k] - before[k]) / M).toFixed(3);
  return { commands: d("commands"), publish: d("publish"), bytes_in: d("in"), bytes_out: d("out") };
}

async function metric(base, series) {
  const text = await call(base, "GET", "/metrics", undefined, true);
  const line = text.split("\n").find((l) => l.startsWith(series + " "));
  return line ? Number(line.split(" ")[1]) : 0;
}

const { sessionId } = JSON.parse(await call(urlB, "POST", "/session"));
const request = { sessionId, deviceId: "watched", type: "d2cMessages" };
await call(urlB, "PUT", "/grants", request, true);
await call(urlB, "PUT", "/subscription", request);
const socket = io(`${urlB}?sessionId=${sessionId}`, { transports: ["websocket"] });
let got = 0;
let waiter = null;
socket.on("data", () => {
  got++;
  if (waiter && got >= waiter.n) waiter.done();
});
await new Promise((ok) => socket.once("connect", ok));
while ((await metric(urlA, 'hubcast_redis_watched_elsewhere_devices{instance="a"}')) < 1) await new Promise((ok) => setTimeout(ok, 50));

async function phase(device, wait) {
  const before = info();
  for (let from = 0; from < M; from += 500) {
    const batch = [];
    for (let n = from; n < Math.min(from + 500, M); n++) batch.push({ deviceId: device, body: { n, v: 21.5 } });
    await call(urlA, "POST", "/ingest", batch, true);
  }
  if (wait) await new Promise((done) => (got >= M ? done() : (waiter = { n: M, done })));
  return per(before, info());
}

const watched = await phase("watched", true);
const unwatched = await phase("nobody", false);
console.log(JSON.stringify({ m: M, delivered_on_b: got, watched, unwatched }));
socket.close();
process.exit(0);
