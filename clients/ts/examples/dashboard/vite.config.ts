import { fileURLToPath } from "node:url";
import { defineConfig } from "vite";

// The TypeScript client, from source: clients/ts/src (its own node_modules resolve its deps).
const clientSrc = fileURLToPath(new URL("../../src/index.ts", import.meta.url));
const clientRoot = fileURLToPath(new URL("../..", import.meta.url));

export default defineConfig({
  resolve: { alias: { "@tracewire/client": clientSrc } },
  server: {
    // localhost, so the server's default CORS (this machine's origins) lets the page call it.
    host: "127.0.0.1",
    port: 5173,
    // The client's sources and dependencies live above this folder.
    fs: { allow: [clientRoot] },
  },
  preview: { host: "127.0.0.1", port: 4173 },
  build: { target: "es2022", sourcemap: true },
});
