// A socket.io-client driven by hubcast's Rust tests: connects the way ux4iot's React client
// does (`io(url + '?sessionId=…', { transports })`) and prints one JSON line per event.
//
// usage: node sio-client.mjs <baseUrl> <sessionId> <transports: websocket|polling|websocket,polling> [count]
// With [count], opens that many sockets (each with its own session id from a comma list).
// SIO_RECONNECT=1 turns automatic reconnection on (as in a browser) and reports each attempt.
import { io } from "socket.io-client";

const [base, sessionArg, transportsArg] = process.argv.slice(2);
const transports = transportsArg.split(",");
const sessions = sessionArg.split(",");
const reconnection = process.env.SIO_RECONNECT === "1";

function print(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

sessions.forEach((sessionId, index) => {
  const socket = io(`${base}?sessionId=${sessionId}`, { transports, reconnection, timeout: 10000 });
  socket.io.on("reconnect_attempt", (attempt) => print({ index, event: "reconnect_attempt", attempt }));
  socket.io.on("open", () => {
    socket.io.engine.on("upgrade", (t) => print({ index, event: "upgrade", transport: t.name }));
  });
  socket.on("connect", () => print({ index, event: "connect", transport: socket.io.engine.transport.name }));
  socket.on("connect_error", (err) => print({ index, event: "connect_error", message: err.message }));
  socket.on("disconnect", (reason) => print({ index, event: "disconnect", reason }));
  socket.on("data", (data) => print({ index, event: "data", data }));
});

// Lines on stdin: "exit" ends the process.
process.stdin.on("data", (chunk) => {
  if (chunk.toString().includes("exit")) process.exit(0);
});
process.stdin.on("end", () => process.exit(0));
