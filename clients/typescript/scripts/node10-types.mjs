// Writes dist/node10.d.ts, the declarations TypeScript's `node10` module resolution loads (`types` in
// package.json; what `"module": "commonjs"` implies in TypeScript 5): dist/index.d.ts with
// vscode-jsonrpc's declarations imported by their file path. dist/index.d.ts imports them as
// 'vscode-jsonrpc/node', a path only vscode-jsonrpc's `exports` map knows, which node10 resolution does
// not read; the node16, nodenext and bundler resolutions read this package's `exports` and load
// dist/index.d.ts. Run after tsc (`npm run build`, and `prepare`).
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const PKG = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const DIST = path.join(PKG, 'dist');
const SPEC = 'vscode-jsonrpc/node';
const BY_PATH = 'vscode-jsonrpc/lib/node/main';

function fail(why) {
  console.error(`node10-types: ${why}`);
  process.exit(1);
}

// BY_PATH must be the declarations vscode-jsonrpc's exports map gives for SPEC
const jsonrpc = path.join(PKG, 'node_modules', 'vscode-jsonrpc');
const exported = JSON.parse(fs.readFileSync(path.join(jsonrpc, 'package.json'), 'utf8')).exports?.['./node']?.types;
if (exported !== `./${BY_PATH.slice('vscode-jsonrpc/'.length)}.d.ts` || !fs.existsSync(path.join(jsonrpc, exported))) {
  fail(`vscode-jsonrpc's exports map no longer gives ${BY_PATH}.d.ts for '${SPEC}' (it gives ${exported}): update this script`);
}
const index = fs.readFileSync(path.join(DIST, 'index.d.ts'), 'utf8');
const specs = new Set([...index.matchAll(/(?:from |import\()'(vscode-jsonrpc[^']*)'/g)].map((m) => m[1]));
if (!specs.has(SPEC) || specs.size !== 1) fail(`dist/index.d.ts imports ${[...specs].join(', ') || 'nothing'} from vscode-jsonrpc, expected only '${SPEC}'`);
fs.writeFileSync(path.join(DIST, 'node10.d.ts'),
  `// dist/index.d.ts for TypeScript's node10 module resolution (written by scripts/node10-types.mjs)\n`
  + index.replaceAll(`'${SPEC}'`, `'${BY_PATH}'`));
