/**
 * The replica transport's retries on the wire's own refusals (src/replicas.ts), against real
 * HTTP/2 servers on loopback: one that resets every stream with a given HTTP/2 code, one that
 * answers GetModelInfo (a Connect router, no engine: this is the client's transport alone;
 * replicas.standalone.test.ts drains a real tracewire server). No tracewire server.
 */

import assert from "node:assert/strict";
import http2 from "node:http2";
import type { AddressInfo } from "node:net";
import { after, before, test } from "node:test";
import { ConnectRouter, createClient } from "@connectrpc/connect";
import { connectNodeAdapter, createGrpcTransport } from "@connectrpc/connect-node";
import { replicaTransport } from "../src/node.js";
import { TraceService } from "../src/gen/tracewire/v1/service_pb.js";

const servers: http2.Http2Server[] = [];
let answered = 0;

const sessions = new Set<http2.ServerHttp2Session>();

async function listen(server: http2.Http2Server): Promise<string> {
  servers.push(server);
  server.on("session", (session) => {
    sessions.add(session);
    session.on("close", () => sessions.delete(session));
  });
  await new Promise<void>((done) => server.listen(0, "127.0.0.1", done));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

/** A server that resets every stream it is sent with `code`, before any response. */
function resetting(code: number): Promise<string> {
  const server = http2.createServer();
  server.on("stream", (stream) => {
    stream.on("error", () => {}); // Node reports the server's own reset there too
    stream.close(code);
  });
  return listen(server);
}

let serving: string;
before(async () => {
  const routes = (router: ConnectRouter): void => {
    router.service(TraceService, {
      getModelInfo: () => {
        answered++;
        return { model: "answering" };
      },
    });
  };
  serving = await listen(http2.createServer(connectNodeAdapter({ routes })));
});

after(() => {
  // close() waits for open sessions, and the clients' session managers keep theirs open
  for (const session of sessions) session.destroy();
  for (const server of servers) server.close();
});

function clientOver(urls: string[]) {
  const transports = urls.map((baseUrl) => createGrpcTransport({ baseUrl }));
  return createClient(TraceService, replicaTransport(transports, { maxAttempts: 5, initialBackoffMs: 1, maxBackoffMs: 5, backoffMultiplier: 2 }));
}

test("a stream refused with REFUSED_STREAM (a call racing a drain's GOAWAY) is retried on the next replica", async () => {
  const refusing = await resetting(http2.constants.NGHTTP2_REFUSED_STREAM);
  const client = clientOver([refusing, serving]);
  const before = answered;
  for (let i = 0; i < 4; i++) {
    // round-robin starts on the refusing replica, then benches it: every call is answered
    assert.equal((await client.getModelInfo({})).model, "answering");
  }
  assert.equal(answered - before, 4);
});

test("a stream reset with another code (the server may have run it) is not retried", async () => {
  const failing = await resetting(http2.constants.NGHTTP2_INTERNAL_ERROR);
  const client = clientOver([failing, serving]);
  const before = answered;
  await assert.rejects(client.getModelInfo({}), /INTERNAL_ERROR/);
  assert.equal(answered, before);
});
