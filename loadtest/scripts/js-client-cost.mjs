// CPU a JavaScript client spends per delivered message, one envelope per frame against batched
// frames (/ws?batch=1). docs/benchmarks/2026-11-25-batched-frames.md. Driven by js-client-cost.sh.
//
//   node js-client-cost.mjs BASE_URL ADMIN_KEY CLIENTS SUBS DEVICES plain|batch WARMUP_S WINDOW_S
//
// Opens CLIENTS sessions, each granted and subscribed to SUBS of the fleet's DEVICES
// (dev-000000…, the harness's ids), one socket each with the `ws` package (as socket.io-client
// uses under Node), and does what an app does with each frame: JSON.parse, then walks the
// envelopes. Prints "ready" once connected, then after WARMUP_S one JSON line with the messages
// received per second and this process's CPU time (user + system) per message over WINDOW_S.
import { createRequire } from "node:module";
const require = createRequire(process.env.WS_MODULE_DIR ? process.env.WS_MODULE_DIR + "/" : import.meta.url);
const WebSocket = require("ws");

const [base, key, clients, subs, devices, mode, warmup, window] = process.argv.slice(2);
const C = +clients, S = +subs, D = +devices, batch = mode === "batch";
const dev = (i) => `dev-${String(i % D).padStart(6, "0")}`;
const admin = { "content-type": "application/json", "shared-access-key": key };

async function pool(n, width, job) {
  let next = 0;
  await Promise.all(Array.from({ length: width }, async () => { while (next < n) await job(next++); }));
}

const sessions = new Array(C);
await pool(C, 16, async (c) => {
  sessions[c] = (await (await fetch(`${base}/session`, { method: "POST" })).json()).sessionId;
  const requests = Array.from({ length: S }, (_, j) => ({ sessionId: sessions[c], deviceId: dev(c * S + j), type: "telemetry", telemetryKey: null }));
  for (const r of requests) {
    const g = await fetch(`${base}/grants`, { method: "PUT", headers: admin, body: JSON.stringify(r) });
    if (g.status !== 204) throw new Error(`PUT /grants ${g.status}`);
  }
  const s = await fetch(`${base}/subscriptions`, { method: "PUT", headers: { "content-type": "application/json" }, body: JSON.stringify(requests) });
  if (s.status !== 200) throw new Error(`PUT /subscriptions ${s.status}`);
});

let messages = 0, frames = 0, keys = 0;
await Promise.all(sessions.map((id) => new Promise((resolve, reject) => {
  const url = `${base.replace(/^http/, "ws")}/ws?sessionId=${id}${batch ? "&batch=1" : ""}`;
  const ws = new WebSocket(url, { perMessageDeflate: false });
  ws.on("open", resolve);
  ws.on("error", reject);
  ws.on("message", (data) => {
    frames++;
    const parsed = JSON.parse(data.toString());
    for (const m of batch ? parsed : [parsed]) {
      messages++;
      if (m.telemetry) keys += Object.keys(m.telemetry).length;
    }
  });
})));
console.log("ready");
await new Promise((r) => setTimeout(r, +warmup * 1000));
const [m0, f0, c0, t0] = [messages, frames, process.cpuUsage(), process.hrtime.bigint()];
await new Promise((r) => setTimeout(r, +window * 1000));
const cpu = process.cpuUsage(c0);
const secs = Number(process.hrtime.bigint() - t0) / 1e9;
const n = messages - m0;
console.log(JSON.stringify({
  mode, clients: C, msgs_per_s: Math.round(n / secs), msgs_per_frame: +(n / Math.max(1, frames - f0)).toFixed(2),
  cpu_cores: +((cpu.user + cpu.system) / 1e6 / secs).toFixed(3), cpu_us_per_msg: +((cpu.user + cpu.system) / Math.max(1, n)).toFixed(3),
}));
process.exit(0);
