// Drives the dashboard in Debian's Chromium through playwright-core and prints what the panels
// show as one JSON line (the pytest side compares it with /metrics and the replayed log).
// usage: node dashboard.mjs BASE_URL LOG_FILE SCREENSHOT_DIR
import { chromium } from "playwright-core";

const [base, log, shots] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"],
});
const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
const errors = [];
page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
page.on("pageerror", (e) => errors.push(String(e)));

async function readKpis() {
  return page.evaluate(() => Object.fromEntries([...document.querySelectorAll(".kpi")].map(
    (el) => [el.id.replace("kpi-", ""), { value: el.dataset.value, title: el.title }])));
}

await page.goto(base + "/");
await page.waitForFunction(() => document.querySelectorAll(".kpi").length > 0);
await page.waitForTimeout(1500);
const live = {
  kpis: await readKpis(),
  gpu: await page.textContent("#gpu"),
  cache: await page.textContent("#cache"),
  requests: await page.$$eval("#requests tbody tr", (rows) => rows.length),
  chart_canvases: await page.$$eval("canvas", (c) => c.length),
  panel_titles: await page.$$eval("h2[data-tip]", (hs) => hs.map((h) => [h.textContent, h.title])),
};
await page.screenshot({ path: `${shots}/live.png`, fullPage: true });

await page.setInputFiles("#open-log", log);
await page.waitForFunction(() => document.getElementById("mode").textContent === "offline");
await page.waitForTimeout(500);
const offline = {
  kpis: await readKpis(),
  gpu: await page.textContent("#gpu"),
  vram: await page.textContent("#vram"),
  status: await page.textContent("#status"),
  requests: await page.$$eval("#requests tbody tr", (rows) => rows.length),
};
await page.screenshot({ path: `${shots}/offline.png`, fullPage: true });
await browser.close();
console.log(JSON.stringify({ live, offline, errors }));
