// Validates KEDA ScaledObjects (a JSON array on stdin) with the validator that
// @kubernetes-models/keda compiles from KEDA's CRD schema; prints one error string (or null) per object.
// Usage: node keda_validate.mjs <npm prefix holding node_modules/@kubernetes-models/keda>
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [prefix] = process.argv.slice(2);
const module = join(prefix, "node_modules/@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject.js");
const { ScaledObject } = await import(pathToFileURL(module));
const objects = JSON.parse(readFileSync(0, "utf8"));
const errors = objects.map((o) => {
  try {
    new ScaledObject(o).validate();
    return null;
  } catch (e) {
    return String(e.message);
  }
});
console.log(JSON.stringify(errors));
