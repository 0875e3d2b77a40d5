/**
 * `dns:` targets in createNodeClient (src/dns_replicas.ts), against real HTTP/2 servers on
 * loopback answering GetModelInfo with their own name (a Connect router, no engine: this is
 * the client's resolving transport alone). Lookup gives addresses without ports, so the two
 * replicas listen on one port at 127.0.0.1 and 127.0.0.2 (Linux routes all of 127/8 to
 * loopback); a fake resolver names them. No tracewire server.
 */

import assert from "node:assert/strict";
import http2 from "node:http2";
import type { AddressInfo } from "node:net";
import { after, before, test } from "node:test";
import { Code, type ConnectRouter } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { createNodeClient, parseDnsTarget, TracewireError, type DnsAddress } from "../src/node.js";
import { TraceService } from "../src/gen/tracewire/v1/service_pb.js";

/** Per replica (its address): the HTTP/2 sessions it was opened, and those still open. */
interface Replica {
  readonly server: http2.Http2Server;
  readonly open: Set<http2.ServerHttp2Session>;
  opened: number;
}

const replicas = new Map<string, Replica>();
let port = 0;

/** Per replica: a promise its answers wait for (a call held in flight). */
const holds = new Map<string, Promise<void>>();

async function serve(host: string): Promise<void> {
  const routes = (router: ConnectRouter): void => {
    router.service(TraceService, {
      getModelInfo: async () => {
        await holds.get(host);
        return { model: host };
      },
    });
  };
  const server = http2.createServer(connectNodeAdapter({ routes }));
  const replica: Replica = { server, open: new Set(), opened: 0 };
  server.on("session", (session) => {
    replica.opened++;
    replica.open.add(session);
    session.on("close", () => replica.open.delete(session));
  });
  await new Promise<void>((done, fail) => {
    server.once("error", fail);
    server.listen(port, host, done);
  });
  port = (server.address() as AddressInfo).port;
  replicas.set(host, replica);
}

before(async () => {
  await serve("127.0.0.1");
  await serve("127.0.0.2"); // the same port
});

after(() => {
  // close() waits for open sessions, and a client that failed keeps none, but be sure
  for (const { server, open } of replicas.values()) {
    for (const session of open) session.destroy();
    server.close();
  }
});

/** A resolver answering `answer` (change it to change the name's addresses), counting its lookups. */
function fakeResolver(answer: string[] | Error) {
  const resolver = {
    answer,
    lookups: [] as string[],
    lookup: async (host: string): Promise<DnsAddress[]> => {
      resolver.lookups.push(host);
      if (resolver.answer instanceof Error) throw resolver.answer;
      return resolver.answer.map((address) => ({ address, family: 4 }));
    },
  };
  return resolver;
}

async function models(client: ReturnType<typeof createNodeClient>, calls: number): Promise<string[]> {
  const answered: string[] = [];
  for (let i = 0; i < calls; i++) answered.push((await client.modelInfo()).model);
  return answered;
}

const sleep = (ms: number) => new Promise((done) => setTimeout(done, ms));

test("a dns: name's addresses are resolved before the first call, and calls go round-robin over them", async () => {
  const resolver = fakeResolver(["127.0.0.1", "127.0.0.2"]);
  const client = createNodeClient(`dns:///tracewire.test:${port}`, { dns: { lookup: resolver.lookup } });
  assert.deepEqual(resolver.lookups, []); // lazily
  try {
    assert.deepEqual(await models(client, 4), ["127.0.0.1", "127.0.0.2", "127.0.0.1", "127.0.0.2"]);
    assert.deepEqual(resolver.lookups, ["tracewire.test"]); // once: within the 30 s
  } finally {
    client.close();
  }
});

test("re-resolved once the interval passed: an address gone from the name gets no more calls, and its call in flight finishes", async () => {
  const resolver = fakeResolver(["127.0.0.1", "127.0.0.2"]);
  const client = createNodeClient(`dns:tracewire.test:${port}`, { dns: { lookup: resolver.lookup, reresolveMs: 50 } });
  const openedBefore = replicas.get("127.0.0.1")!.opened;
  let release = (): void => {};
  try {
    assert.deepEqual(await models(client, 2), ["127.0.0.1", "127.0.0.2"]);
    assert.equal(replicas.get("127.0.0.2")!.open.size, 1);
    holds.set("127.0.0.2", new Promise<void>((done) => (release = done)));
    assert.equal((await client.modelInfo()).model, "127.0.0.1");
    const inFlight = client.modelInfo(); // on 127.0.0.2, held there
    resolver.answer = ["127.0.0.1"]; // (a pod leaving the Service while it drains)
    await sleep(80);
    assert.deepEqual(await models(client, 4), ["127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.1"]);
    assert.ok(resolver.lookups.length >= 2, `${resolver.lookups.length} lookups`);
    release();
    assert.equal((await inFlight).model, "127.0.0.2"); // its connection was not cut under it
    // the address still listed kept its one connection
    assert.equal(replicas.get("127.0.0.1")!.opened - openedBefore, 1);
  } finally {
    release();
    holds.delete("127.0.0.2");
    client.close();
  }
});

test("a call every replica refused makes the next one resolve the name again, before the interval", async () => {
  // 127.0.0.3: nothing listens there, every connection is refused (UNAVAILABLE)
  const resolver = fakeResolver(["127.0.0.3"]);
  const client = createNodeClient(`dns:///tracewire.test:${port}`, { dns: { lookup: resolver.lookup } });
  try {
    await assert.rejects(client.modelInfo(), (error: TracewireError) => error.code === Code.Unavailable);
    resolver.answer = ["127.0.0.2"];
    assert.equal((await client.modelInfo()).model, "127.0.0.2");
    assert.equal(resolver.lookups.length, 2);
  } finally {
    client.close();
  }
});

test("a name that fails to resolve, or resolves to nothing, fails the call with UNAVAILABLE naming the target", async () => {
  const target = `dns:///nowhere.test:${port}`;
  for (const answer of [new Error("getaddrinfo ENOTFOUND nowhere.test"), []]) {
    const client = createNodeClient(target, { dns: { lookup: fakeResolver(answer).lookup } });
    try {
      await assert.rejects(client.modelInfo(), (error: TracewireError) => {
        assert.equal(error.code, Code.Unavailable);
        assert.ok(error.message.includes(target), error.message);
        assert.match(error.message, answer instanceof Error ? /ENOTFOUND nowhere\.test/ : /no addresses/);
        return true;
      });
    } finally {
      client.close();
    }
  }
});

test("a re-resolution that fails keeps the addresses known so far", async () => {
  const resolver = fakeResolver(["127.0.0.2"]);
  const client = createNodeClient(`dns:///tracewire.test:${port}`, { dns: { lookup: resolver.lookup, reresolveMs: 20 } });
  try {
    assert.equal((await client.modelInfo()).model, "127.0.0.2");
    resolver.answer = new Error("getaddrinfo EAI_AGAIN tracewire.test");
    await sleep(40);
    assert.equal((await client.modelInfo()).model, "127.0.0.2");
    assert.equal(resolver.lookups.length, 2); // it did ask again
  } finally {
    client.close();
  }
});

test("the OS resolver: dns:///localhost:PORT reaches the server on 127.0.0.1", async () => {
  const client = createNodeClient(`dns:///localhost:${port}`);
  try {
    assert.equal((await client.modelInfo()).model, "127.0.0.1");
  } finally {
    client.close();
  }
});

test("parseDnsTarget: gRPC's dns: forms; a DNS server of its own or a bad port are refused naming the target", () => {
  assert.deepEqual(parseDnsTarget("dns:///tracewire.default.svc:50051"), { host: "tracewire.default.svc", port: 50051 });
  assert.deepEqual(parseDnsTarget("dns:tracewire:50051"), { host: "tracewire", port: 50051 });
  assert.deepEqual(parseDnsTarget("dns:///[::1]:50051"), { host: "::1", port: 50051 });
  assert.deepEqual(parseDnsTarget("dns:///tracewire"), { host: "tracewire", port: 443 }); // gRPC's default
  assert.equal(parseDnsTarget("ipv4:10.0.0.1:50051"), undefined);
  assert.throws(() => parseDnsTarget("dns://8.8.8.8/tracewire:50051"), /target: dns:\/\/8\.8\.8\.8\/tracewire:50051: a DNS server of its own/);
  assert.throws(() => parseDnsTarget("dns:///tracewire:99999"), /target: dns:\/\/\/tracewire:99999 is not dns:\/\/\/host:port/);
  assert.throws(() => createNodeClient("dns:///tracewire:50051", { dns: { reresolveMs: -1 } }), /dns\.reresolveMs: -1/);
});
