#!/usr/bin/env node
// Copies the typed protocol client (the repository's clients/typescript/src, with its generated wire
// types) into src/sidecar-client/ so that tsc compiles it with the extension and vsce packages it
// (out/sidecar-client/). A build step, not a fork: src/sidecar-client/ is gitignored and rewritten
// on every build, so the extension always uses the client as it is in the repository.
import * as fs from 'node:fs';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const FROM = path.resolve(HERE, '..', 'typescript', 'src');
const TO = path.join(HERE, 'src', 'sidecar-client');
if (!fs.existsSync(path.join(FROM, 'index.ts'))) {
  console.error(`vendor-client: ${FROM}/index.ts not found (the repository's clients/typescript)`);
  process.exit(1);
}
fs.rmSync(TO, { recursive: true, force: true });
const copied = [];
(function copy(dir) {
  for (const e of fs.readdirSync(dir, { withFileTypes: true })) {
    const src = path.join(dir, e.name);
    const rel = path.relative(FROM, src);
    if (e.isDirectory()) { copy(src); continue; }
    if (!e.name.endsWith('.ts') || e.name.endsWith('.test.ts')) continue;
    fs.mkdirSync(path.dirname(path.join(TO, rel)), { recursive: true });
    fs.writeFileSync(path.join(TO, rel), `// Copied from clients/typescript/src/${rel} by scripts/vendor-client.mjs: edit it there.\n` + fs.readFileSync(src, 'utf8'));
    copied.push(rel);
  }
})(FROM);
console.error(`vendor-client: ${copied.join(', ')} -> src/sidecar-client/`);
