// Validates the ServiceMonitor and PrometheusRule objects of a JSON file
// (one object, or a List) against prometheus-operator's CRD schemas, with
// the validators @kubernetes-models/prometheus-operator generates from
// them (installed by scripts/ci/install-manifest-validators):
//
//     node scripts/ci/validate-custom-resources.mjs NODE_MODULES_DIR FILE.json
//
// Prints one line per object; exit 1 if one is invalid, 2 for an object of
// any other kind (nothing is let through unchecked).
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import { join } from "node:path";

const [modules, file] = process.argv.slice(2);
const load = async (kind) =>
  (await import(pathToFileURL(join(modules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1", `${kind}.js`)).href))[kind];
const models = {
  ServiceMonitor: await load("ServiceMonitor"),
  PrometheusRule: await load("PrometheusRule"),
};
const doc = JSON.parse(readFileSync(file, "utf8"));
const objects = doc.kind === "List" ? doc.items : [doc];
let rc = 0;
for (const o of objects) {
  const name = `${o.kind}/${o.metadata?.name}`;
  const Model = o.apiVersion === "monitoring.coreos.com/v1" ? models[o.kind] : undefined;
  if (!Model) {
    console.log(`UNKNOWN ${name} (${o.apiVersion}): no CRD schema here`);
    rc = Math.max(rc, 2);
    continue;
  }
  try {
    new Model(o).validate();
    console.log(`ok ${name}`);
  } catch (e) {
    console.log(`INVALID ${name}: ${e.message}`);
    rc = Math.max(rc, 1);
  }
}
process.exit(rc);
