// Minimal CDP client over `ws` with flat-session support (sessionId on every message).
import { createRequire } from 'node:module';
import * as http from 'node:http';
const require = createRequire(import.meta.url);
// `ws` comes from itest-host/node_modules (code-server depends on it).
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
const HERE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const WebSocket = require(path.join(HERE, 'itest-host', 'node_modules', 'ws'));

export const getJSON = (url) => new Promise((res, rej) => http.get(url, (r) => { let d = ''; r.on('data', (c) => (d += c)); r.on('end', () => { try { res(JSON.parse(d)); } catch (e) { rej(e); } }); }).on('error', rej));
export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export async function connect(wsUrl) {
  const ws = new WebSocket(wsUrl, { perMessageDeflate: false, maxPayload: 256 * 1024 * 1024 });
  await new Promise((res, rej) => { ws.once('open', res); ws.once('error', rej); });
  let id = 0; const pending = new Map(); const listeners = [];
  ws.on('message', (buf) => {
    const m = JSON.parse(buf);
    if (m.id && pending.has(m.id)) { const { res, rej, method } = pending.get(m.id); pending.delete(m.id); m.error ? rej(new Error(`${method}: ${m.error.message}`)) : res(m.result); }
    else if (m.method) for (const l of listeners) l(m.method, m.params, m.sessionId);
  });
  return {
    send(method, params = {}, sessionId) {
      return new Promise((res, rej) => { const i = ++id; pending.set(i, { res, rej, method }); ws.send(JSON.stringify({ id: i, method, params, sessionId })); });
    },
    on(fn) { listeners.push(fn); return () => listeners.splice(listeners.indexOf(fn), 1); },
    close() { ws.close(); },
  };
}

// Poll `fn` until it returns a truthy value (or throws past the deadline).
export async function waitFor(what, fn, timeoutMs = 30000, everyMs = 200) {
  const end = Date.now() + timeoutMs; let last;
  while (Date.now() < end) { try { const v = await fn(); if (v) return v; } catch (e) { last = e; } await sleep(everyMs); }
  throw new Error(`timeout waiting for ${what}${last ? ': ' + last.message : ''}`);
}
