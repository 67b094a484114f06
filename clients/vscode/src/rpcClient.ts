// The extension's one access to the wire: the repository's typed protocol client
// (clients/typescript, copied into src/sidecar-client/ at build time by scripts/vendor-client.mjs).
// Every other module imports protocol names from here, never from the client directly.
export * from './sidecar-client/index';
