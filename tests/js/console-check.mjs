// Drives the /console page in Debian's chromium (puppeteer-core, no downloaded browser):
// logs in with the admin key, publishes values with POST /ingest, and waits until they show up
// in the device list (polled REST) and in the device pane (the page's own WebSocket).
// Usage: node console-check.mjs <base-url> <admin-key> [screenshot.png]
// Prints one JSON line {"ok": true, ...} and exits 0, or prints the error and exits 1.
import puppeteer from "puppeteer-core";

const [base, key, screenshot] = process.argv.slice(2);
const executablePath = process.env.CHROMIUM || "/usr/bin/chromium";
const WAIT = 15000;

async function ingest(messages) {
  const res = await fetch(`${base}/ingest`, {
    method: "POST",
    headers: { "Content-Type": "application/json", "Shared-Access-Key": key },
    body: JSON.stringify(messages),
  });
  if (res.status !== 200) throw new Error(`POST /ingest: ${res.status} ${await res.text()}`);
}

const browser = await puppeteer.launch({
  executablePath,
  headless: true,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"],
});
const problems = [];
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1400, height: 900 });
  page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
  // A device without a twin answers 404 on GET /deviceTwin, which the page shows as such;
  // Chromium logs every 4xx fetch as a console error, so those are told apart by URL.
  page.on("console", (m) => {
    const url = m.location()?.url || "";
    if (m.type() === "error" && !(url.includes("/deviceTwin/") && m.text().includes("404"))) problems.push(`console error: ${m.text()} ${url}`);
  });
  // Chromium reports a fetch answered 204 (no body) as "aborted" once the answer is in: only a
  // request that never got an answer is a problem.
  page.on("requestfailed", (r) => { if (!r.response()) problems.push(`request failed: ${r.method()} ${r.url()} ${r.failure()?.errorText}`); });
  // Everything the page loads comes from hubcast itself (no CDN: it works offline).
  const foreign = [];
  page.on("request", (r) => { if (!r.url().startsWith(base) && !r.url().startsWith(base.replace("http", "ws"))) foreign.push(r.url()); });

  await page.goto(`${base}/console`, { waitUntil: "load" });
  await page.type("#key", key);
  await page.click("#login-form button[type=submit]");
  await page.waitForSelector("#login", { hidden: true, timeout: WAIT });

  // A value published over HTTP appears in the device list.
  await ingest([{ deviceId: "console-pump-1", body: { pressure: 4.25, running: true } },
                { deviceId: "console-pump-1", source: "deviceConnectionStateEvents", properties: { opType: "deviceConnected" },
                  body: { sequenceNumber: "000000000000000001D5" } }]);
  await page.waitForFunction(() => {
    const row = document.querySelector('#devices tr[data-device="console-pump-1"]');
    return row && row.textContent.includes("pressure=4.25") && row.textContent.includes("connected");
  }, { timeout: WAIT });

  // Search narrows the list.
  await page.type("#search", "pump-1");
  await page.waitForFunction(() => [...document.querySelectorAll("#devices tr")].every((r) => r.dataset.device.includes("pump-1"))
    && document.querySelector("#page-info").textContent.includes("of 1"), { timeout: WAIT });

  // Picking the device subscribes the page's own session; live values arrive over its WebSocket.
  await page.click('#devices tr[data-device="console-pump-1"]');
  await page.waitForFunction(() => document.querySelector("#sel-name").textContent === "console-pump-1", { timeout: WAIT });
  await page.waitForFunction(() => document.querySelector("#conn").textContent === "live", { timeout: WAIT });
  // The page subscribes its kinds one after another after the click (telemetry first, then
  // connection state, then device-to-cloud messages): publish each kind until one arrives.
  const publishUntilSeen = async (message, seenInPage, what) => {
    const deadline = Date.now() + WAIT;
    for (let n = 1; ; n += 1) {
      await ingest([message(n)]);
      const seen = await page.waitForFunction(seenInPage, { timeout: 500 }).then(() => true, () => false);
      if (seen) return n;
      if (Date.now() > deadline) throw new Error(`no live ${what} in the device pane`);
    }
  };
  const n = await publishUntilSeen((seq) => ({ deviceId: "console-pump-1", body: { pressure: 5.5, seq } }),
    () => [...document.querySelectorAll("#messages li")]
      .some((li) => li.dataset.kind === "telemetry" && li.textContent.includes("5.5")), "telemetry");
  await publishUntilSeen(() => ({ deviceId: "console-pump-1", body: ["a", "d2c", "array"] }),
    () => [...document.querySelectorAll("#messages li")]
      .some((li) => li.dataset.kind === "d2c" && li.textContent.includes('["a","d2c","array"]')), "device-to-cloud message");

  // The metrics panels fill in: per-core table and a rate.
  await page.waitForFunction(() => document.querySelectorAll("#cores tr").length >= 1
    && document.querySelector("#c-in").textContent !== "–", { timeout: WAIT });

  // The log level switch answers 204.
  await page.select("#loglevel", "verbose");
  await page.waitForFunction(() => document.querySelector("#loglevel-state").textContent === "set to verbose", { timeout: WAIT });

  if (screenshot) {
    // For docs/console.png: the whole list, a simulated device picked, charts with some history.
    await page.evaluate(() => { document.querySelector("#search").value = ""; document.querySelector("#search").dispatchEvent(new Event("input")); });
    await page.waitForSelector('#devices tr[data-device="sim-device-0001"]', { timeout: WAIT });
    await page.click('#devices tr[data-device="sim-device-0001"]');
    await new Promise((r) => setTimeout(r, 12000));
    await page.screenshot({ path: screenshot, fullPage: true });
  }
  if (foreign.length) throw new Error(`the page fetched from elsewhere: ${foreign.join(", ")}`);
  if (problems.length) throw new Error(problems.join("\n"));
  console.log(JSON.stringify({ ok: true, publishes: n }));
} catch (e) {
  console.log(JSON.stringify({ ok: false, error: String(e && e.stack || e), problems }));
  process.exitCode = 1;
} finally {
  await browser.close();
}
