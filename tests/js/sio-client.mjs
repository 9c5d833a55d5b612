// A socket.io-client driven by hubcast's Rust tests: connects the way ux4iot's React client
// does (`io(url + '?sessionId=…', { transports })`) and prints one JSON line per event.
//
// usage: node sio-client.mjs <baseUrl> <sessionId> <transports: websocket|polling|websocket,polling> [count]
// With [count], opens that many sockets (each with its own session id from a comma list).
// SIO_RECONNECT=1 turns automatic reconnection on (as in a browser) and reports each attempt;
// SIO_RECONNECT_DELAY=<ms> sets its delay (socket.io-client's reconnectionDelay and
// reconnectionDelayMax; default 1000 and 5000).
// SIO_PRINT_OFFSETS=1 adds connection state recovery to the lines: `recovered` and whether the
// client holds a pid on connect, and each data event's last string argument (its offset) and
// argument count. The data handler still reads its first argument as ux4iot's onData(data) does.
import { io } from "socket.io-client";

const [base, sessionArg, transportsArg] = process.argv.slice(2);
const transports = transportsArg.split(",");
const sessions = sessionArg.split(",");
const reconnection = process.env.SIO_RECONNECT === "1";
const printOffsets = process.env.SIO_PRINT_OFFSETS === "1";
const delay = process.env.SIO_RECONNECT_DELAY ? Number(process.env.SIO_RECONNECT_DELAY) : undefined;
const delays = delay === undefined ? {} : { reconnectionDelay: delay, reconnectionDelayMax: delay };

function print(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

sessions.forEach((sessionId, index) => {
  const socket = io(`${base}?sessionId=${sessionId}`, { transports, reconnection, timeout: 10000, ...delays });
  socket.io.on("reconnect_attempt", (attempt) => print({ index, event: "reconnect_attempt", attempt }));
  socket.io.on("open", () => {
    socket.io.engine.on("upgrade", (t) => print({ index, event: "upgrade", transport: t.name }));
  });
  socket.on("connect", () => {
    const line = { index, event: "connect", transport: socket.io.engine.transport.name };
    if (printOffsets) Object.assign(line, { recovered: socket.recovered, pid: typeof socket._pid === "string" });
    print(line);
  });
  socket.on("connect_error", (err) => print({ index, event: "connect_error", message: err.message }));
  socket.on("disconnect", (reason) => print({ index, event: "disconnect", reason }));
  socket.on("data", (data, ...rest) => {
    const line = { index, event: "data", data };
    if (printOffsets) {
      const last = rest[rest.length - 1];
      Object.assign(line, { args: 1 + rest.length, offset: typeof last === "string" ? last : null });
    }
    print(line);
  });
});

// Lines on stdin: "exit" ends the process.
process.stdin.on("data", (chunk) => {
  if (chunk.toString().includes("exit")) process.exit(0);
});
process.stdin.on("end", () => process.exit(0));
