// Builds web/dist: our ES modules and styles plus uPlot from node_modules (installed from the
// npm registry, locked by package-lock.json). Nothing is fetched at run time.
import { cpSync, mkdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const dist = join(here, "dist");
rmSync(dist, { recursive: true, force: true });
mkdirSync(join(dist, "vendor"), { recursive: true });
cpSync(join(here, "src"), dist, { recursive: true });
cpSync(join(here, "node_modules/uplot/dist/uPlot.esm.js"), join(dist, "vendor/uPlot.esm.js"));
cpSync(join(here, "node_modules/uplot/dist/uPlot.min.css"), join(dist, "vendor/uPlot.min.css"));
console.log(`dashboard built into ${dist}`);
