// node --test reporter: writes one JSON document summarising top-level tests and their outcome.
export default async function* jsonReporter(source) {
  const tests = [];
  const counts = { pass: 0, fail: 0, skip: 0, todo: 0 };
  const diagnostics = [];
  for await (const ev of source) {
    if (ev.type === 'test:diagnostic') { diagnostics.push(ev.data.message); continue; }
    if (ev.type === 'test:stderr' || ev.type === 'test:stdout') { diagnostics.push(`${ev.type}: ${ev.data.message}`.slice(0, 2000)); continue; }
    if (ev.type !== 'test:pass' && ev.type !== 'test:fail') continue;
    const d = ev.data;
    if (d.details?.type === 'suite') continue;
    const status = d.skip !== undefined && d.skip !== false ? 'skip'
      : d.todo !== undefined && d.todo !== false ? 'todo' : ev.type === 'test:pass' ? 'pass' : 'fail';
    counts[status] += 1;
    const err = d.details?.error;
    tests.push({
      name: d.name, file: d.file, nesting: d.nesting, status,
      durationMs: d.details?.duration_ms,
      error: err ? String(err.cause?.stack ?? err.cause ?? err.message ?? err).slice(0, 2000) : undefined,
    });
  }
  yield JSON.stringify({ ...counts, total: tests.length, tests, diagnostics }, null, 2) + '\n';
}
