// Time to replay N missed messages to one plain WebSocket client (issue 24, "Measured";
// docs/design/recovery.md step 8). Driven by replay-time.sh.
//
//   node replay-time.mjs BASE_URL ADMIN_KEY N ROUNDS
//
// Each round: a new session granted and subscribed to one device, a socket with `offsets=1`
// that takes one message and keeps its offset, closed; N messages ingested (POST /ingest,
// batches of 500) while it is away; then a socket with `&since=<offset>`. Prints one JSON line
// per round: ms from the new socket's creation to its first frame ({"recovered":…}) and to the
// N-th replayed envelope, whether all N arrived once and in order.
import { createRequire } from "node:module";
const require = createRequire(process.env.WS_MODULE_DIR ? process.env.WS_MODULE_DIR + "/" : import.meta.url);
const WebSocket = require("ws");

const [base, key, nArg, roundsArg] = process.argv.slice(2);
const N = +nArg, ROUNDS = +roundsArg;
const admin = { "content-type": "application/json", "shared-access-key": key };
const wsBase = base.replace(/^http/, "ws");

async function ingest(device, from, count) {
  for (let i = from; i < from + count; i += 500) {
    const batch = [];
    for (let j = i; j < Math.min(from + count, i + 500); j++) batch.push({ deviceId: device, body: { n: j } });
    const r = await fetch(`${base}/ingest`, { method: "POST", headers: admin, body: JSON.stringify(batch) });
    if (r.status !== 200) throw new Error(`POST /ingest ${r.status}: ${await r.text()}`);
  }
}

async function metric(name) {
  const text = await (await fetch(`${base}/metrics`, { headers: admin })).text();
  const line = text.split("\n").find((l) => l.startsWith(name + " ") || l.startsWith(name + "{"));
  return line ? +line.split(" ").pop() : NaN;
}

for (let round = 1; round <= ROUNDS; round++) {
  const device = `replay-${round}`;
  const sessionId = (await (await fetch(`${base}/session`, { method: "POST" })).json()).sessionId;
  const req = { sessionId, deviceId: device, type: "telemetry", telemetryKey: null };
  const g = await fetch(`${base}/grants`, { method: "PUT", headers: admin, body: JSON.stringify(req) });
  if (g.status !== 204) throw new Error(`PUT /grants ${g.status}`);
  const s = await fetch(`${base}/subscriptions`, { method: "PUT", headers: { "content-type": "application/json" }, body: JSON.stringify([req]) });
  if (s.status !== 200) throw new Error(`PUT /subscriptions ${s.status}`);

  // First socket: one message, its offset, then away.
  const offset = await new Promise((resolve, reject) => {
    const ws = new WebSocket(`${wsBase}/ws?sessionId=${sessionId}&offsets=1`, { perMessageDeflate: false });
    ws.on("error", reject);
    ws.on("open", () => ingest(device, -1, 1).catch(reject));
    ws.on("message", (data) => {
      const m = JSON.parse(data.toString());
      if (m.offset) { ws.on("close", () => resolve(m.offset)); ws.close(); }
    });
  });
  // The last replayed-to-be message is in the history once hubcast counts N more frames in it.
  const replayedBefore = await metric("hubcast_recovery_replayed_frames_total");
  await ingest(device, 0, N);
  await new Promise((r) => setTimeout(r, 500));
  const bytes = await metric("hubcast_recovery_history_bytes");

  const result = await new Promise((resolve, reject) => {
    const t0 = performance.now();
    let first = null, got = 0, inOrder = true, head = null;
    const ws = new WebSocket(`${wsBase}/ws?sessionId=${sessionId}&offsets=1&since=${offset}`, { perMessageDeflate: false });
    ws.on("error", reject);
    ws.on("message", (data) => {
      const m = JSON.parse(data.toString());
      if (first === null) { first = performance.now() - t0; head = m; if (!m.recovered) { ws.close(); resolve({ head }); } return; }
      if (m.body?.n !== undefined || m.telemetry?.n !== undefined) {
        const n = m.telemetry?.n ?? m.body?.n;
        if (n !== got) inOrder = false;
        got++;
        if (got === N) { const last = performance.now() - t0; ws.close(); resolve({ head, first_frame_ms: +first.toFixed(1), last_replayed_ms: +last.toFixed(1), replayed: got, in_order: inOrder }); }
      }
    });
    setTimeout(() => resolve({ head, replayed: got, timeout: true }), 30000);
  });
  const replayed = (await metric("hubcast_recovery_replayed_frames_total")) - replayedBefore;
  console.log(JSON.stringify({ round, n: N, history_bytes: bytes, ...result, hubcast_replayed_frames: replayed }));
}
