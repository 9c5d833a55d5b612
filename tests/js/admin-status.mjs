// GET /status as ux4iot's admin SDK (ux4iot-admin-node 4.2) reads it: the SDK's `status()`
// is an axios instance made with `baseURL` and a `Shared-Access-Key` header (it always sends
// the key) that returns `response.data` of `GET /status` as its string result. axios parses a
// JSON answer into an object, so an app comparing the result with "OK" sees the difference.
// The SDK itself is not on the npm registry this project reaches; axios, its one runtime
// dependency, is, and this is the call it makes (src/Ux4iotAdminSDK.ts, `status()`).
//
// Usage: node admin-status.mjs BASE_URL ADMIN_KEY  -> prints JSON.stringify(result).
import axios from "axios";

const [base, key] = process.argv.slice(2);
const sdk = axios.create({ baseURL: base, headers: { "Shared-Access-Key": key } });
try {
  const response = await sdk.get("/status");
  console.log(JSON.stringify({ result: response.data }));
} catch (e) {
  console.log(JSON.stringify({ error: String(e), status: e.response?.status }));
  process.exit(1);
}
